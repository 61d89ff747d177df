"""Decode speed: cached decode against recomputing the full forward for every new token.

Both paths are jitted, greedy, and keep the chosen token on device (no host sync per token);
each is timed end to end (prefill included for the cache) after a warm-up that compiles every
shape it will use. The no-cache baseline runs the forward on the prefix padded up to a multiple
of ``bucket`` tokens (a handful of compiles instead of one per length), so its cost grows with
the context the way recomputation does; the cached path always has the same shapes.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.data.tokenizer import PAD
from tpulab.inference.decode import Decoder, ModelFns


def _greedy_next(fns: ModelFns, params, tokens_bt, pos):
    """No cache: the full forward over the (padded) prefix, argmax at position ``pos - 1``, written at ``pos``."""
    logits_btv = fns.full_logits(params, tokens_bt)
    nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits_btv, pos - 1, axis=1, keepdims=False), axis=-1)
    return jax.lax.dynamic_update_slice(tokens_bt, nxt[:, None].astype(jnp.int32), (0, pos))


def _cached_step(fns: ModelFns, params, cache, token_b, pos):
    logits_bv, cache = fns.decode(params, cache, token_b, pos)
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), cache


def measure(fns: ModelFns, prompt_len: int, new_tokens: int, *, policy: str = "fp32", bucket: int = 32,
            repeats: int = 3) -> dict:
    """Best-of-``repeats`` tokens/s for both paths on one prompt of ``prompt_len`` tokens (batch 1)."""
    s = fns.shape.max_len
    if prompt_len + new_tokens > s:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds {s}")
    prompt = (np.arange(prompt_len, dtype=np.int32) * 7 % 256)[None]
    dec = Decoder(fns, policy)
    step = jax.jit(functools.partial(_cached_step, fns), donate_argnums=(1,))
    nocache = jax.jit(functools.partial(_greedy_next, fns))

    def run_cached():
        tokens = np.full((1, s), PAD, np.int32)
        tokens[:, :prompt_len] = prompt
        logits, cache = dec.prefill(tokens, prompt_len)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = [tok]
        for i in range(new_tokens - 1):
            tok, cache = step(dec.params, cache, tok, jnp.int32(prompt_len + i))
            out.append(tok)
        return jnp.stack(out, 1)

    def run_nocache():
        width = lambda n: min(s, -(-n // bucket) * bucket)  # noqa: E731
        buf = jnp.asarray(np.pad(prompt, ((0, 0), (0, s - prompt_len)), constant_values=PAD))
        for i in range(new_tokens):
            pos = prompt_len + i
            w = width(pos + 1)
            buf = buf.at[:, :w].set(nocache(fns.params, buf[:, :w], jnp.int32(pos)))
        return buf[:, prompt_len:prompt_len + new_tokens]

    def best(fn):
        jax.block_until_ready(fn())  # warm-up: compiles every shape used
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return min(times), np.asarray(out)

    t_cached, out_c = best(run_cached)
    t_full, out_f = best(run_nocache)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "cache": policy,
            "cached_tokens_per_s": new_tokens / t_cached, "recompute_tokens_per_s": new_tokens / t_full,
            "speedup": t_full / t_cached, "same_tokens": bool(np.array_equal(out_c, out_f))}


def decode_speed(source, prompt_lens: tuple[int, ...] | None = None, new_tokens: int | None = None,
                 **kw) -> list[dict]:
    """Rows for two prompt lengths (default: 1/8 and 1/2 of the cache length, 1/4 of it new tokens)."""
    fns = ModelFns(source.model)
    s = fns.shape.max_len
    prompt_lens = prompt_lens or (max(1, s // 8), s // 2)
    new_tokens = new_tokens or max(1, s // 4)
    return [measure(fns, p, new_tokens, **kw) for p in prompt_lens]


def speed_table(rows: list[dict]) -> str:
    lines = ["| prompt tokens | new tokens | cached tok/s | recompute tok/s | speed-up | same tokens |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['new_tokens']} | {r['cached_tokens_per_s']:.1f} | "
                     f"{r['recompute_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['same_tokens']} |")
    return "\n".join(lines)
