"""What each KV-cache precision costs and loses, measured against the no-cache full forward.

On held-out windows (whole validation documents the model never trained on) each policy runs the
real cached path: prefill of the first ``prompt_len`` tokens, then one decode per remaining token
(teacher-forced). Its logits are compared with the full forward's at every position: max |logit
difference|, mean KL(full || cached) of the next-token distributions, and the held-out loss
through the cache. Greedy agreement: greedy generation through the cache from held-out prompts
up to the cache length, then the full forward over that same text; the fraction of generated
positions where the full forward's argmax is the token the cached path chose.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.config import check, field
from tpulab.data.tokenizer import PAD
from tpulab.evidence.report_kit import figure, table
from tpulab.model import kvcache as kv
from tpulab.model.decode import ModelFns
from tpulab.progress import progress

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig
    from tpulab.train.restore import Restored

# FP32 cached decode vs the full forward: same math, different summation order/shapes in the
# matmuls, so they agree to float32 rounding: |logit diff| <= FP32_LOGIT_ATOL.
FP32_LOGIT_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class KVEvalConfig:
    """Sizes of the KV-cache comparison."""

    windows: int = field(16, "held-out windows for the logit, KL and loss comparison")
    prompt_len: int = field(0, "tokens prefilled before decoding starts; 0 = max_seq_len // 8")
    min_generated: int = field(256, "greedy tokens generated per policy, at least")
    min_prompts: int = field(8, "greedy generations per policy, at least")
    policies: tuple[str, ...] = field(
        kv.POLICIES,
        "cache policies compared, fp32 first: the others' byte ratios and the int8 bounds read it",
    )

    def __post_init__(self):
        check(
            bool(self.policies)
            and self.policies[0] == "fp32"
            and set(self.policies) <= set(kv.POLICIES)
            and len(set(self.policies)) == len(self.policies),
            f"policies={self.policies} must be distinct of {', '.join(kv.POLICIES)}, fp32 first",
        )
        check(self.windows > 0, f"windows={self.windows} must be positive")
        check(self.prompt_len >= 0, f"prompt_len={self.prompt_len} must be >= 0")
        check(
            self.min_generated > 0 and self.min_prompts > 0,
            "min_generated and min_prompts must be positive",
        )


def heldout_windows(config: RunConfig, n: int) -> np.ndarray:
    """``n`` validation windows [n, seq_len + 1], evenly spaced over the held-out documents."""
    from tpulab.data.corpus import load_corpus
    from tpulab.data.pipeline import build_splits

    val = build_splits(load_corpus(config.data.path), config.data).val_windows
    idx = np.linspace(0, len(val) - 1, n).round().astype(int)
    return val[idx]


def _teacher_forced(fns: ModelFns, policy: str, params, tokens_bt, prompt_len: int):
    """Cached-path logits [B, T, V]: prefill ``prompt_len`` tokens, then decode the rest one by
    one."""
    b, t = tokens_bt.shape
    logits_bpv, cache = fns.forward_cached(
        params, fns.shape.init(policy, b), tokens_bt[:, :prompt_len], 0
    )

    def step(cache, xs):
        token_b, pos = xs
        logits_bv, cache = fns.decode(params, cache, token_b, pos)
        return cache, logits_bv

    _, logits_tbv = jax.lax.scan(
        step, cache, (tokens_bt[:, prompt_len:].T, jnp.arange(prompt_len, t))
    )
    return jnp.concatenate([logits_bpv, logits_tbv.transpose(1, 0, 2)], axis=1)


def _greedy(fns: ModelFns, policy: str, params, prompts_bp):
    """Greedy tokens [B, S - P] through prefill + decode, filling the cache to its length."""
    b, p = prompts_bp.shape
    s = fns.shape.max_len
    tokens_bs = jnp.concatenate([prompts_bp, jnp.full((b, s - p), PAD, jnp.int32)], axis=1)
    logits_bv, cache = fns.prefill(policy, params, tokens_bs, p)
    first_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)

    def step(carry, pos):
        cache, token_b = carry
        logits_bv, cache = fns.decode(params, cache, token_b, pos)
        nxt = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return (cache, nxt), nxt

    _, rest_tb = jax.lax.scan(step, (cache, first_b), jnp.arange(p, s - 1))
    return jnp.concatenate([first_b[:, None], rest_tb.T], axis=1), cache


def _log_softmax(x):
    return jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1)


def compare_policy(
    fns: ModelFns,
    policy: str,
    windows: np.ndarray,
    prompts_bp: np.ndarray,
    full_btv: jax.Array,
    prompt_len: int,
) -> dict:
    """One table row: bytes/token, logit/KL/loss errors vs ``full_btv``, and greedy agreement."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    mask = targets != PAD
    cached = jax.jit(functools.partial(_teacher_forced, fns, policy), static_argnums=2)(
        fns.params, inputs, prompt_len
    )
    lp_full, lp_cached = _log_softmax(full_btv), _log_softmax(cached)
    # KL >= 0; float32 rounding can leave -1e-9 where the distributions are identical.
    kl_bt = jnp.maximum(jnp.sum(jnp.exp(lp_full) * (lp_full - lp_cached), axis=-1), 0.0)
    nll_bt = -jnp.take_along_axis(lp_cached, targets[..., None], axis=-1)[..., 0]
    diff_bt = jnp.max(jnp.abs(cached - full_btv), axis=-1)
    gen_bg, cache = jax.jit(functools.partial(_greedy, fns, policy))(fns.params, prompts_bp)
    text_bs = jnp.concatenate([prompts_bp, gen_bg], axis=1)
    full_argmax = jnp.argmax(jax.jit(fns.full_logits)(fns.params, text_bs), axis=-1)
    p = prompts_bp.shape[1]
    agree = np.asarray(full_argmax[:, p - 1 : -1] == gen_bg)
    m = jnp.asarray(mask)
    return {
        "precision": policy,
        "cache_dtype": kv.describe_policy(policy)["storage_dtype"],
        "bytes_per_token": kv.bytes_per_token(cache),
        "max_abs_logit_diff": float(jnp.max(jnp.where(m, diff_bt, 0.0))),
        "mean_kl": float(jnp.sum(kl_bt * m) / m.sum()),
        "greedy_agreement": float(agree.mean()),
        "greedy_tokens": int(agree.size),
        "heldout_loss": float(jnp.sum(nll_bt * m) / m.sum()),
    }


def kvcache_table(source: Restored, cfg: KVEvalConfig = KVEvalConfig()) -> dict:
    """Rows for ``cfg.policies`` (fp32, bf16 and int8) plus the full-forward reference, for a
    ``Restored`` model."""
    fns = ModelFns(source.model)
    s = fns.shape.max_len
    prompt_len = cfg.prompt_len or max(1, s // 8)
    check(prompt_len < s, f"prompt_len={prompt_len} must be below max_seq_len={s}")
    n_prompts = max(cfg.min_prompts, math.ceil(cfg.min_generated / (s - prompt_len)))
    windows = heldout_windows(source.config, max(cfg.windows, n_prompts))
    prompts = windows[:n_prompts, :prompt_len]
    windows = windows[: cfg.windows]
    full = jax.jit(fns.full_logits)(fns.params, windows[:, :-1])
    lp = _log_softmax(full)
    mask = windows[:, 1:] != PAD
    nll = -np.take_along_axis(np.asarray(lp), windows[:, 1:, None], axis=-1)[..., 0]
    rows = [
        compare_policy(fns, p, windows, prompts, full, prompt_len)
        for p in progress(cfg.policies, "kvcache")
    ]
    for r in rows:
        r["ratio_to_fp32"] = r["bytes_per_token"] / rows[0]["bytes_per_token"]
    prec = source.config.precision
    return {
        "rows": rows,
        "reference": {
            "path": "full forward, no cache",
            "heldout_loss": float((nll * mask).sum() / mask.sum()),
        },
        "fp32_logit_atol": FP32_LOGIT_ATOL,
        "dtypes": {
            "weights": prec.param_dtype,
            "activations": prec.compute_dtype,
            "accumulation": prec.accum_dtype,
            "int8_scales": jnp.dtype(kv.SCALE_DTYPE).name,
            "cache": {p: kv.describe_policy(p) for p in cfg.policies},
        },
        "shapes": {
            "heldout_windows": list(windows[:, :-1].shape),
            "prompt_len": prompt_len,
            "greedy_prompts": n_prompts,
            "cache_len": s,
            "model": dataclasses.asdict(source.config.model),
        },
        "checkpoint": {"step": source.step, "manifest_sha256": source.checkpoint_digest},
    }


def markdown_table(result: dict) -> str:
    headers = ["cache", "bytes/token", "vs fp32", "max abs logit diff", "mean KL (nats)"]
    rows = [
        (
            r["precision"],
            f"{r['bytes_per_token']:.0f}",
            f"{r['ratio_to_fp32']:.3f}",
            f"{r['max_abs_logit_diff']:.2e}",
            f"{r['mean_kl']:.2e}",
            f"{r['greedy_agreement']:.4f} ({r['greedy_tokens']} tok)",
            f"{r['heldout_loss']:.4f}",
        )
        for r in result["rows"]
    ]
    rows.append(("(no cache)", *[""] * 5, f"{result['reference']['heldout_loss']:.4f}"))
    return table([*headers, "greedy agreement", "held-out loss"], rows)


def plot(result: dict, path: Path) -> None:
    rows = result["rows"]
    names = [r["precision"] for r in rows]
    with figure(path, ncols=3, figsize=(12, 3.4)) as (_, axes):
        axes[0].bar(names, [r["bytes_per_token"] for r in rows], color="tab:blue")
        axes[0].set_title("cache bytes per token (all layers)")
        x = np.arange(len(rows))
        axes[1].bar(
            x - 0.2,
            [max(r["max_abs_logit_diff"], 1e-12) for r in rows],
            0.4,
            label="max |logit diff|",
        )
        axes[1].bar(x + 0.2, [max(r["mean_kl"], 1e-12) for r in rows], 0.4, label="mean KL")
        axes[1].set_xticks(x, names)
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=8)
        axes[1].set_title("error vs full forward")
        bars = axes[2].bar(names, [1 - r["greedy_agreement"] for r in rows], color="tab:red")
        axes[2].bar_label(
            bars, labels=[f"{1 - r['greedy_agreement']:.2%}" for r in rows], fontsize=8
        )
        axes[2].set_ylim(0, max(0.02, 1.2 * max(1 - r["greedy_agreement"] for r in rows)))
        axes[2].axhline(0.01, color="gray", linestyle="--", linewidth=1, label="int8 bound (1%)")
        axes[2].legend(fontsize=8)
        axes[2].set_title("greedy disagreement (1 - agreement)")


KVCACHE_FILES = ("kvcache.json", "kvcache.md", "kvcache.png")  # the report, all of it


def write_kvcache_report(
    source: Restored, out_dir: str | Path, cfg: KVEvalConfig = KVEvalConfig()
) -> dict:
    """kvcache.json, kvcache.md and kvcache.png in ``out_dir``; returns the JSON."""
    from tpulab.evidence.provenance import describe_hardware, environment

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = kvcache_table(source, cfg)
    result["environment"] = environment()
    result["hardware"] = describe_hardware(result["environment"])
    report, table, figure = (out / name for name in KVCACHE_FILES)
    atomic_write_json(report, result)
    atomic_write_bytes(table, (markdown_table(result) + "\n").encode())
    plot(result, figure)
    return result
