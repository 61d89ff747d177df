"""Masked bytes: the byte Transformer as an encoder (``model.causal: false``), trained to recover
hidden bytes of the pretraining windows, its masks drawn from a key in the checkpointed state.

Two modes (``objective.mlm.mode``):

- ``bernoulli``: every byte position is chosen with probability ``mask_ratio`` (BERT: 0.15); a
  chosen position shows MASK (80%), a uniform random byte (10%) or its own byte (10%);
- ``span``: ByT5's span corruption. A row of L byte positions hides
  noise = min(max(round(L d), 1), L - 1) bytes (d: ``noise_density``, 0.15) in
  spans = min(max(round(noise / mean_span), 1), noise, L - noise) spans (mean 20 bytes), the
  span lengths a random segmentation, the row starting with a kept span (T5's
  ``random_spans_noise_mask``); every hidden byte shows MASK.

Only byte positions are ever chosen: BOS (a document's start) and PAD (a window's tail) never are.
The loss is the NLL over the 256 bytes at the chosen positions alone, divided by their count over
the global batch (the ``targets`` metric of every step: the normaliser, written in the run). MASK
is a third special id (``data.tokenizer.MASK``, 258): runs set ``model.vocab_size: 259``.

The state is pretraining's with one more key, ``mask_key``: split every step, one half carried,
one drawing the step's masks, so a resumed run draws the masks the uninterrupted one would. The
evaluation masks come from one fixed key (the same every evaluation).

Audits (``MLM.audits``, written to audits.json by the loop before the first step): mask counts
(a pinned mask for a seeded key, the span formula exact in every row, the density over 50 masks),
the reduction (the loss at a zeroed head is ln 256; the logged count of loss terms is the count of
chosen positions; one device, 4 accumulated micro-batches and 4 virtual devices give one loss on
one batch) and leakage (what a chosen position shows, by share; no BOS or PAD chosen; nothing
unchosen changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from tpulab.config import check, field
from tpulab.data.tokenizer import MASK, MASKED_DEFINITION
from tpulab.train import sharding
from tpulab.train.objectives.pretrain import Pretrain
from tpulab.train.registry import register_objective
from tpulab.train.step import (
    Carried,
    Steps,
    gradient_steps,
    masked_xent,
    merge_model,
    transformer_graph,
)
from tpulab.train.virtual_devices import on_devices

BYTES = 256  # the loss is over the bytes: a target is never a special token
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # of bernoulli's chosen positions; the rest show their byte
SHOWN = ("mask", "random", "unchanged")  # what a chosen position shows
SHARES = (MASK_SHARE, RANDOM_SHARE, round(1.0 - MASK_SHARE - RANDOM_SHARE, 6))
DENSITY_MASKS = 50  # masks the density audit averages over
DENSITY_TOLERANCE = 0.01
MICRO_BATCHES = 4
LOSS_RTOL = 1e-5  # one batch's loss over devices and micro-batches: reduction order only
# The pinned masks: PINNED_SEED's key on ``pinned_tokens()`` with ``pinned_options(mode)``, as
# sha256 of (inputs, targets, weights). They change only if the mask code (or JAX's RNG) changes.
PINNED_SEED = 20260105
PINNED = {
    "bernoulli": "9a7f89478a455c8f8dbb5a455439542f27dc58326edce944ace98feeb8dee9cd",
    "span": "5ef7d57af7ac0446c5ab45c6b397c473c67c13983792a354b47cebdc1c005e02",
}


class MaskedState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array  # dropout key, as pretraining's
    mask_key: jax.Array  # uint32[2]: split every step, one half drawing the step's masks


@dataclasses.dataclass(frozen=True)
class MLMConfig:
    """How the hidden bytes are chosen (``objective.mlm.<field>``)."""

    mode: Literal["bernoulli", "span"] = field(
        "bernoulli", "bernoulli (each byte at mask_ratio, 80/10/10) | span (ByT5 spans)"
    )
    mask_ratio: float = field(0.15, "bernoulli: the probability a byte position is chosen")
    noise_density: float = field(0.15, "span: the share of a row's bytes hidden")
    mean_span: float = field(20.0, "span: the mean hidden span, in bytes")
    mask_seed: int = field(0, "seeds the mask key in the state (and the evaluation's fixed key)")
    audit_devices: int = field(
        4, "virtual CPU devices the reduction audit compares one device with (0: not compared)"
    )

    def __post_init__(self):
        for name in ("mask_ratio", "noise_density"):
            value = getattr(self, name)
            check(0.0 < value < 1.0, f"objective.mlm.{name}={value} must be in (0, 1)")
        check(self.mean_span >= 1.0, f"objective.mlm.mean_span={self.mean_span} must be >= 1")
        check(
            self.audit_devices == 0 or 2 <= self.audit_devices <= 64,
            f"objective.mlm.audit_devices={self.audit_devices} must be 0 or in [2, 64]",
        )


def span_counts(length: int, density: float, mean_span: float) -> tuple[int, int]:
    """(hidden bytes, spans) of a row of ``length`` byte positions (none below 2 bytes)."""
    if length < 2:
        return 0, 0
    noise = min(max(int(np.round(length * density)), 1), length - 1)
    spans = min(max(int(np.round(noise / mean_span)), 1), noise, length - noise)
    return noise, spans


def _segments(key, items, segments, width: int) -> jax.Array:
    """[width] lengths of ``segments`` random non-empty segments of ``items`` (the rest 0): the
    cuts are a uniform choice of segments - 1 of the items - 1 gaps."""
    slot = jnp.arange(width)
    u = jnp.where(slot < items - 1, jax.random.uniform(key, (width,)), 2.0)
    cut = (jnp.argsort(jnp.argsort(u)) < segments - 1) & (slot < items - 1)
    first = jnp.concatenate([jnp.zeros(1, bool), cut[:-1]])
    return jax.ops.segment_sum(
        (slot < items).astype(jnp.int32), jnp.cumsum(first), num_segments=width
    )


def _span_row(key, eligible_t, noise_l, spans_l) -> jax.Array:
    """One row's hidden positions: kept and hidden spans alternate from the first byte position."""
    width = eligible_t.shape[0]
    length = jnp.sum(eligible_t)
    noise, spans = noise_l[length], spans_l[length]
    k_noise, k_kept = jax.random.split(key)
    lengths = jnp.stack(
        [_segments(k_kept, length - noise, spans, width), _segments(k_noise, noise, spans, width)],
        axis=1,
    ).reshape(-1)
    starts = jnp.minimum(jnp.cumsum(lengths)[:-1], width)
    boundaries = jnp.zeros(width + 1, jnp.int32).at[starts].add(1)[:width]
    hidden = jnp.cumsum(boundaries) % 2 == 1
    local = jnp.arange(width) - jnp.argmax(eligible_t)  # byte positions are one run per row
    return eligible_t & (local >= 0) & hidden[jnp.clip(local, 0, width - 1)]


def choose(options: MLMConfig, key, tokens_bt) -> jax.Array:
    """[B, T] bool: the positions whose bytes the loss predicts (byte positions only)."""
    eligible = tokens_bt < BYTES
    if options.mode == "bernoulli":
        return eligible & (jax.random.uniform(key, tokens_bt.shape) < options.mask_ratio)
    width = tokens_bt.shape[1]
    table = [span_counts(n, options.noise_density, options.mean_span) for n in range(width + 1)]
    noise_l, spans_l = (jnp.asarray([t[i] for t in table], jnp.int32) for i in (0, 1))
    keys = jax.random.split(key, tokens_bt.shape[0])
    return jax.vmap(_span_row, in_axes=(0, 0, None, None))(keys, eligible, noise_l, spans_l)


def corrupt(options: MLMConfig, key, tokens_bt) -> dict[str, jax.Array]:
    """The model's inputs, the targets (the original bytes; 0 where not chosen) and the weights
    (1.0 at chosen positions) of one batch of token rows."""
    k_choose, k_kind, k_byte = jax.random.split(key, 3)
    chosen = choose(options, k_choose, tokens_bt)
    if options.mode == "span":
        shown = jnp.full_like(tokens_bt, MASK)
    else:
        u = jax.random.uniform(k_kind, tokens_bt.shape)
        random_bytes = jax.random.randint(k_byte, tokens_bt.shape, 0, BYTES, tokens_bt.dtype)
        shown = jnp.where(
            u < MASK_SHARE, MASK, jnp.where(u < MASK_SHARE + RANDOM_SHARE, random_bytes, tokens_bt)
        )
    return {
        "inputs": jnp.where(chosen, shown, tokens_bt),
        "targets": jnp.where(chosen, tokens_bt, 0),
        "weights": chosen.astype(jnp.float32),
    }


def byte_nll(graphdef):
    """(mean NLL over the weighted positions, their count): the masked loss without dropout."""

    def nll(params, batch):
        logits = merge_model(graphdef, params)(batch["inputs"], deterministic=True)
        return masked_xent(logits[..., :BYTES], batch["targets"], batch["weights"])

    return nll


def devices_loss(config, mesh, arrays) -> dict:
    """The audit's loss on one corrupted batch, its rows over ``mesh`` (``virtual_devices``)."""
    graphdef, init_params = transformer_graph(config)
    shapes = jax.eval_shape(init_params)
    leaves = [arrays[f"param_{i}"] for i in range(len(jax.tree.leaves(shapes)))]
    params = jax.tree.unflatten(jax.tree.structure(shapes), leaves)
    rows = NamedSharding(mesh, sharding.BATCH_SPEC)
    batch = {k: jax.device_put(arrays[k], rows) for k in ("inputs", "targets", "weights")}
    mean, count = jax.jit(byte_nll(graphdef))(params, batch)
    return {"loss": float(mean), "count": int(count), "devices": int(mesh.devices.size)}


def pinned_tokens() -> np.ndarray:
    """[2, 64]: a row opening a document (BOS first) and a document's tail (PAD after 40 bytes)."""
    rows = np.arange(128, dtype=np.int32).reshape(2, 64) * 7 % BYTES
    rows[0, 0] = 256
    rows[1, 40:] = 257
    return rows


def pinned_options(mode: str) -> MLMConfig:
    """The defaults; span with 3-byte spans (at 20, a 64-byte row's one span is always last)."""
    return MLMConfig(mode=mode, mean_span=3.0 if mode == "span" else 20.0)


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode() + np.ascontiguousarray(np.asarray(arrays[k])).tobytes())
    return h.hexdigest()


def _within(value: float, expected: float, n: int) -> float:
    """A share's tolerance over n draws: 5 binomial standard deviations (exact shares: 0)."""
    return 5.0 * math.sqrt(expected * (1.0 - expected) / max(n, 1))


@register_objective
class MLM(Pretrain):
    """Masked-byte training on pretraining's windows (its data, split and identity)."""

    kind = "mlm"
    Config = MLMConfig
    tokenizer = MASKED_DEFINITION
    eval_before_training = True  # val_loss at step 0: where the curve starts (about ln 256)

    @classmethod
    def check_run(cls, config) -> None:
        super().check_run(config)
        check(
            not config.model.causal,
            "objective.kind=mlm trains an encoder: set model.causal=false (a causal model cannot "
            "see the bytes after a hidden one)",
        )
        check(
            config.model.vocab_size > MASK,
            f"objective.kind=mlm shows MASK (id {MASK}): model.vocab_size="
            f"{config.model.vocab_size} must be >= {MASK + 1}",
        )

    @classmethod
    def corrupt(cls, options: MLMConfig, key, tokens_bt) -> dict[str, jax.Array]:
        """What the steps and the audits train on (a test's controls replace it)."""
        return corrupt(options, key, tokens_bt)

    @classmethod
    def build_steps(cls, config, mesh) -> Steps:
        options = config.objective.options
        graphdef, init_params = transformer_graph(config)
        nll = byte_nll(graphdef)
        eval_key = jax.random.fold_in(jax.random.PRNGKey(options.mask_seed), 1)

        def start(state) -> MaskedState:
            key = jax.random.fold_in(jax.random.PRNGKey(options.mask_seed), 0)
            return MaskedState(*state, mask_key=key)

        def prepare(state: MaskedState, batch):
            mask_key, step_key = jax.random.split(state.mask_key)
            return state._replace(mask_key=mask_key), cls.corrupt(
                options, step_key, batch["inputs"]
            )

        def evaluate(params, frozen, batch):
            mean, count = nll(params, cls.corrupt(options, eval_key, batch["inputs"]))
            return {"val_loss": (mean * count, count)}

        return gradient_steps(
            config,
            mesh,
            graphdef=graphdef,
            init_params=init_params,
            loss=cls.loss(graphdef),
            evaluate=evaluate,
            carried=Carried(start, prepare),
        )

    @staticmethod
    def loss(graphdef):
        def loss(params, frozen, batch, dropout_key):
            model = merge_model(graphdef, params, frozen)
            logits = model(batch["inputs"], deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
            value, count = masked_xent(logits[..., :BYTES], batch["targets"], batch["weights"])
            return value, {"targets": count.astype(jnp.int32)}  # the normaliser: a count

        return loss

    def steps(self, mesh) -> Steps:
        return self.build_steps(self.config, mesh)

    @classmethod
    def abstract_state(cls, config, mesh) -> Any:
        return cls.build_steps(config, mesh).abstract_state()

    def describe(self, steps, state) -> dict:
        o = self.options
        masking = {"mode": o.mode, "mask_seed": o.mask_seed}
        if o.mode == "bernoulli":
            masking |= {"mask_ratio": o.mask_ratio, "shares": dict(zip(SHOWN, SHARES))}
        else:
            masking |= {"noise_density": o.noise_density, "mean_span": o.mean_span}
        return {
            "masking": masking,
            "loss_normaliser": "the count of chosen byte positions in the global batch "
            "(each step's 'targets')",
        }

    # --- audits: run by the loop before a fresh run's first step (audits.json) -----------------

    def audits(self, steps, state) -> dict[str, dict]:
        host = multihost_utils.process_allgather(
            {"params": state.params, "mask_key": state.mask_key, "rng": state.rng}, tiled=True
        )
        # on the host's CPU, whatever trains: the virtual devices it is compared with are CPUs
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return self._audits(host)

    def _audits(self, host) -> dict[str, dict]:
        options = self.options
        _, step_key = jax.random.split(host["mask_key"])  # what the first step draws its masks with
        _, dropout_key = jax.random.split(host["rng"])
        tokens = np.asarray(next(iter(self.data().train(0, 1)))["inputs"])  # step 1's batch

        @jax.jit
        def corrupt_fn(key, rows):
            return self.corrupt(options, key, rows)

        keys = [jax.random.fold_in(step_key, i) for i in range(DENSITY_MASKS)]
        rows = _tiled(tokens, DENSITY_ROWS)
        many = [_host(corrupt_fn(k, rows)) for k in keys]
        return {
            "mask_counts": self._mask_counts(corrupt_fn, rows, many),
            "reduction": self._reduction(
                host["params"], _host(corrupt_fn(step_key, tokens)), dropout_key
            ),
            "leakage": _leakage(options, rows, many),
        }

    def _mask_counts(self, corrupt_fn, rows, many) -> dict:
        o, width = self.options, rows.shape[1]
        key = jax.random.PRNGKey(PINNED_SEED)
        pinned = digest(_host(self.corrupt(pinned_options(o.mode), key, pinned_tokens())))
        full = np.random.default_rng(0).integers(0, BYTES, rows.shape, dtype=np.int32)
        chosen_full = sum(
            int(
                corrupt_fn(jax.random.fold_in(jax.random.PRNGKey(PINNED_SEED), i), full)[
                    "weights"
                ].sum()
            )
            for i in range(DENSITY_MASKS)
        )
        density = chosen_full / (DENSITY_MASKS * full.size)
        if o.mode == "bernoulli":
            expected, tolerance, exact = o.mask_ratio, DENSITY_TOLERANCE, True
        else:  # round(L d) / L: within half a byte of d
            expected = o.noise_density
            tolerance = max(DENSITY_TOLERANCE, 0.5 / width)
            exact = all(_spans_exact(o, rows, m["weights"] > 0) for m in many)
        return {
            "passed": bool(
                pinned == PINNED[o.mode] and abs(density - expected) <= tolerance and exact
            ),
            "pinned_mask": pinned == PINNED[o.mode],
            "pinned_sha256": pinned,
            "density": round(density, 6),
            "expected_density": expected,
            "tolerance": tolerance,
            "masks": DENSITY_MASKS,
            "positions": int(DENSITY_MASKS * full.size),
            **({"span_counts_exact": exact} if o.mode == "span" else {}),
        }

    def _reduction(self, params, masked, dropout_key) -> dict:
        graphdef, _ = transformer_graph(self.config)
        nll = jax.jit(byte_nll(graphdef))
        zeroed = jax.tree_util.tree_map_with_path(
            lambda p, x: (
                np.zeros_like(x) if sharding.leaf_path(p).endswith("final_norm/scale") else x
            ),
            params,
        )
        zero_head = float(nll(zeroed, masked)[0])
        value, aux = jax.jit(self.loss(graphdef))(params, None, masked, dropout_key)
        chosen = int(masked["weights"].sum())
        whole = float(nll(params, masked)[0])
        parts = [
            nll(params, {k: v[i] for k, v in masked.items()})
            for i in np.array_split(np.arange(len(masked["weights"])), MICRO_BATCHES)
        ]
        accumulated = float(sum(m * c for m, c in parts) / sum(c for _, c in parts))
        record = {
            "zero_head_loss": zero_head,
            "expected_zero_head_loss": math.log(BYTES),
            "step1_loss": float(value),
            "loss_terms": int(aux["targets"]),
            "chosen_positions": chosen,
            "normaliser": "count of chosen positions in the global batch",
            "one_device_loss": whole,
            f"{MICRO_BATCHES}_micro_batches_loss": accumulated,
            "mean_of_micro_batch_means": float(np.mean([float(m) for m, _ in parts])),
        }
        same = [abs(accumulated - whole) <= LOSS_RTOL * abs(whole)]
        n = self.options.audit_devices
        if n:
            pad = -len(masked["weights"]) % n
            arrays = {
                k: np.concatenate([v, np.zeros((pad, v.shape[1]), v.dtype)])
                for k, v in masked.items()
            }
            arrays |= {f"param_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
            there = on_devices(self.config, f"{__name__}:devices_loss", arrays, n)
            record[f"{n}_devices_loss"] = there["loss"]
            same += [abs(there["loss"] - whole) <= LOSS_RTOL * abs(whole), there["count"] == chosen]
        record["passed"] = bool(
            abs(zero_head - math.log(BYTES)) <= 0.01 * math.log(BYTES)
            and record["loss_terms"] == chosen
            and chosen > 0
            and all(same)
        )
        return record


DENSITY_ROWS = 2000  # byte positions per mask the audits draw, at least (rows of the step's batch)


def _host(arrays: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in arrays.items()}


def _tiled(tokens: np.ndarray, positions: int) -> np.ndarray:
    """The batch's rows repeated to at least ``positions`` positions (whole batches)."""
    copies = max(1, -(-positions // tokens.size))
    return np.concatenate([tokens] * copies)


def _spans_exact(options: MLMConfig, rows: np.ndarray, chosen: np.ndarray) -> bool:
    """Every row hides exactly the formula's bytes in exactly its spans."""
    for row, hidden in zip(rows, chosen):
        noise, spans = span_counts(
            int((row < BYTES).sum()), options.noise_density, options.mean_span
        )
        starts = int((hidden & ~np.concatenate([[False], hidden[:-1]])).sum())
        if int(hidden.sum()) != noise or starts != spans:
            return False
    return True


def _leakage(options: MLMConfig, rows: np.ndarray, many: list[dict]) -> dict:
    """What every chosen position shows, by share; no special position chosen; nothing else
    changed; every target the original byte."""
    tokens = np.broadcast_to(rows, (len(many), *rows.shape))
    inputs = np.stack([m["inputs"] for m in many])
    targets = np.stack([m["targets"] for m in many])
    chosen = np.stack([m["weights"] for m in many]) > 0
    n = int(chosen.sum())
    shown = inputs[chosen]
    measured = {
        "mask": float(np.mean(shown == MASK)) if n else 0.0,
        "unchanged": float(np.mean(shown == tokens[chosen])) if n else 0.0,
    }
    measured["random"] = 1.0 - measured["mask"] - measured["unchanged"]
    if options.mode == "span":
        expected = {"mask": 1.0, "random": 0.0, "unchanged": 0.0}
    else:  # a random byte equal to the original one shows it unchanged
        expected = {
            "mask": MASK_SHARE,
            "random": RANDOM_SHARE * (BYTES - 1) / BYTES,
            "unchanged": SHARES[2] + RANDOM_SHARE / BYTES,
        }
    shares_ok = all(
        abs(measured[k] - expected[k]) <= _within(measured[k], expected[k], n) + 1e-9
        for k in expected
    )
    counts = {
        "special_positions_chosen": int((chosen & (tokens >= BYTES)).sum()),
        "unchosen_positions_changed": int((~chosen & (inputs != tokens)).sum()),
        "targets_not_the_original": int((chosen & (targets != tokens)).sum()),
        "chosen_showing_a_special": int((chosen & (inputs >= BYTES) & (inputs != MASK)).sum()),
    }
    return {
        "passed": bool(n > 0 and shares_ok and not any(counts.values())),
        "chosen": n,
        "shares": {k: round(v, 6) for k, v in measured.items()},
        "expected_shares": {k: round(v, 6) for k, v in expected.items()},
        **counts,
    }
