"""The one place that says what a generation request may ask for, and how a token is sampled.

``SamplingConfig`` and ``prompt_ids`` validate every field (the CLI and the HTTP service both call
them, so a bound changes here or nowhere). ``sample_tokens`` is the on-device sampler (greedy,
temperature, top-k) used by the step-by-step path and by the compiled loop alike: row ``b`` at
step ``i`` draws with ``fold_in(key_b, i)``, so a row's tokens depend only on its own logits, key
and parameters, never on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.config import check, field
from tpulab.data.tokenizer import BOS, VOCAB_SIZE
from tpulab.errors import TpulabError
from tpulab.model.config import MAX_TEMPERATURE, MIN_TEMPERATURE

MAX_SEED = 2**63 - 1
MAX_PROMPT_CHARS = (
    4096  # coarse bound before encoding (the service checks it before parsing further)
)


def _finite_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TpulabError(f"{name}={value!r} must be a number")
    if not math.isfinite(float(value)):
        raise TpulabError(f"{name}={value} must be a finite number")
    return float(value)


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TpulabError(f"{name}={value!r} must be an integer")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new: int = field(64, "tokens to generate (at most; a stop token ends a row early)")
    temperature: float = field(
        0.8, f"softmax temperature; 0 = greedy, else in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
    )
    top_k: int = field(0, "sample among the k most likely tokens; 0 = all")
    seed: int = field(0, "sampling seed: the same seed gives the same text")

    def __post_init__(self):
        max_new, top_k, seed = (_integer(n, getattr(self, n)) for n in ("max_new", "top_k", "seed"))
        t = _finite_number("temperature", self.temperature)
        check(max_new > 0, f"max_new={max_new} must be positive")
        check(
            t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
            f"temperature={t:g} must be 0 (greedy) or in "
            f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
        )
        check(0 <= top_k <= VOCAB_SIZE, f"top_k={top_k} must be in [0, {VOCAB_SIZE}]")
        check(0 <= seed <= MAX_SEED, f"seed={seed} must be an integer in [0, 2**63 - 1]")
        object.__setattr__(self, "temperature", t)


def encode_prompt(prompt) -> np.ndarray:
    """UTF-8 bytes of the prompt; refuses text that is not valid Unicode (lone surrogates: the CLI
    decodes undecodable argv bytes into those, JSON allows "\\ud800")."""
    if not isinstance(prompt, str):
        raise TpulabError(f"prompt must be a string, not {type(prompt).__name__}")
    if not prompt:
        raise TpulabError("prompt is empty (give at least one character)")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise TpulabError(f"prompt has {len(prompt)} characters, at most {MAX_PROMPT_CHARS}")
    try:
        data = prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TpulabError(
            f"prompt is not valid UTF-8 text (bad character at offset {e.start})"
        ) from None
    return np.frombuffer(data, np.uint8).astype(np.int32)


def prompt_ids(prompt, max_len: int, max_new: int) -> np.ndarray:
    """[BOS] + UTF-8 bytes, checked to be non-empty valid text that leaves room for ``max_new``
    tokens."""
    ids = np.concatenate([[BOS], encode_prompt(prompt)]).astype(np.int32)
    if len(ids) + max_new > max_len:
        raise TpulabError(
            f"prompt ({len(ids) - 1} bytes + BOS) plus max_new={max_new} exceeds the model's "
            f"{max_len} positions"
        )
    return ids


def key_data(seed: int) -> np.ndarray:
    """uint32[2] threefry key data for a 63-bit seed (hi, lo words: what ``jax.random.key`` makes of
    it with 64-bit integers), built on the host so no x64 mode is needed."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def token_logprobs(logits_v: jax.Array, tokens: jax.Array, temperature) -> jax.Array:
    """log p(token) under the distribution ``sample_tokens`` draws from when top_k is 0,
    softmax(logits / t), in float32; ``logits_v`` [..., V], ``tokens`` [...], ``temperature``
    broadcastable to ``tokens`` (a greedy row, t = 0, is scored at t = 1). The sampler records
    these for the tokens it emits (``ModelFns.generate(logprobs=True)``) and a trainer computes
    them for the same tokens with this same function (PPO's importance ratios)."""
    t = jnp.asarray(temperature, jnp.float32)
    t = jnp.where(t > 0, t, 1.0)[..., None]
    logp_v = jax.nn.log_softmax(logits_v.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp_v, tokens.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def sample_tokens(
    logits_bv: jax.Array, keys_b2: jax.Array, step, temperature_b: jax.Array, top_k_b: jax.Array
) -> jax.Array:
    """Next token per row [B] int32: argmax where temperature is 0, else a draw from
    softmax(logits / t) restricted to the top_k largest logits (0 = all), keyed by
    fold_in(key, step).

    The draw (a threefry key per row) runs only when some row samples, and the sort behind top-k
    only when some sampling row asks for it (``lax.cond``): in an all-greedy decode loop they were
    about a tenth of every step on XLA:CPU. Whichever branch runs computes exactly what it did
    unconditionally."""
    logits = logits_bv.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling_b = temperature_b > 0

    def sample(_):
        t = jnp.where(sampling_b, temperature_b, 1.0).astype(jnp.float32)[:, None]
        z = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t
        v = z.shape[-1]
        k = jnp.clip(top_k_b.astype(jnp.int32), 0, v)

        def keep_top_k(z):
            desc = -jnp.sort(-z, axis=-1)
            kth = jnp.take_along_axis(desc, jnp.maximum(k - 1, 0)[:, None], axis=-1)
            return jnp.where((k[:, None] > 0) & (z < kth), -jnp.inf, z)

        z = jax.lax.cond(jnp.any(sampling_b & (k > 0)), keep_top_k, lambda z: z, z)

        def draw(key2, z_v):
            key = jax.random.fold_in(jax.random.wrap_key_data(key2, impl="threefry2x32"), step)
            return jax.random.categorical(key, z_v).astype(jnp.int32)

        drawn = jax.vmap(draw)(keys_b2.astype(jnp.uint32), z)
        return jnp.where(sampling_b, drawn, greedy)

    return jax.lax.cond(jnp.any(sampling_b), sample, lambda _: greedy, None)
