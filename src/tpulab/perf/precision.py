"""`tpulab precision`: an explicit precision policy table for a trained run, measured against fp32.

Rows (weights / activations / accumulation / KV cache):

- ``fp32``: the reference;
- ``bf16-compute``: fp32 parameters, bf16 activations and matmul inputs (mixed precision training);
- ``bf16-params``: parameters and activations in bf16 (the optimizer moments would follow);
- ``int8-weights``: inference only; every matmul weight quantized symmetric per output channel
  (``scale = max|w| / 127`` per column of a Dense kernel, per row of the tied embedding), stored
  int8 and dequantized for the matmul;
- ``int8-cache``: fp32 weights, keys/values through the int8 KV cache (``model.kvcache``),
  teacher-forced one token at a time.

Norms, softmax, logits and the loss stay fp32 in every row (``PrecisionConfig.accum_dtype``).
Every row, fp32 included, is measured against an independent reference: the same checkpoint's
forward written again in float64 NumPy from the architecture (``reference_logits``), so the fp32
row shows fp32's own rounding error instead of a zero from comparing a forward with itself, and a
fp32 row that disagrees with the reference (``FP32_TOL``) is a model bug, refused. Each row:
held-out loss, max |logit diff| and mean KL(reference || row) over held-out positions, greedy
agreement (the fraction of held-out positions whose argmax equals the reference's), bytes of the
weights
(and cache bytes per token), the forward time on the held-out batch here, and for the training
rows the train step time here (``tpulab.perf.bench``). On a CPU bf16 is emulated, so bf16 times
here say nothing about a TPU, where bf16 is the MXU's native input.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import table

if TYPE_CHECKING:
    from tpulab.model.config import ModelConfig

ROWS = ("fp32", "bf16-compute", "bf16-params", "int8-weights", "int8-cache")
_POLICY = {  # weights, activations, accumulation, kv cache
    "fp32": ("float32", "float32", "float32", "fp32"),
    "bf16-compute": ("float32", "bfloat16", "float32", "bf16"),
    "bf16-params": ("bfloat16", "bfloat16", "float32", "bf16"),
    "int8-weights": (
        "int8 per-channel (dequantized to float32 for the matmul)",
        "float32",
        "float32",
        "fp32",
    ),
    "int8-cache": ("float32", "float32", "float32", "int8"),
}


def quantize_per_channel(w, axis: int):
    """Symmetric int8 along ``axis`` (the output channel); returns (int8 values, fp32 scales)."""
    import jax.numpy as jnp

    reduce = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=reduce, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


def _int8_params(params: dict) -> tuple[dict, int]:
    """Params with every matrix fake-quantized per output channel; and the int8 + scale bytes."""
    out, nbytes = {}, 0
    for name, w in params.items():
        if w.ndim >= 2:
            axis = 0 if name.endswith("embedding") else -1  # tied head: one row per output token
            q, scale = quantize_per_channel(w, axis)
            out[name] = (q.astype(np.float32) * scale).astype(w.dtype)
            nbytes += q.size + scale.size * 4
        else:
            out[name] = w
            nbytes += w.size * w.dtype.itemsize
    return out, nbytes


# The fp32 forward against the float64 reference, max |logit diff| over 8 held-out windows: 6.0e-7
# (tiny config, 40 steps) and 3.5e-6 (default, 100 steps), fp32 rounding; a RoPE base of 500 instead
# of 10000 in the reference moves them by 1.2e-2 and 4.5 (measured 2026-12-01, jax 0.10.2, CPU).
FP32_TOL = 1e-3


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_logits(params: dict, cfg: ModelConfig, tokens_bt: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of the deterministic forward in float64 NumPy, from the architecture alone.

    Written from the model's description (``tpulab.model.transformer``: pre-norm blocks, RMSNorm
    with eps 1e-6, fused QKV, half-split RoPE, causal softmax attention, tanh-GELU MLP, final norm,
    tied or separate head), sharing no code with it: ``params`` by their ``ModelFns`` names,
    ``cfg`` a ``ModelConfig``. A test plants a difference (another RoPE base) and sees the fp32
    check fail.
    """
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    b, t = tokens_bt.shape
    h, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    ang = np.arange(t, dtype=np.float64)[:, None] * cfg.rope_base ** (-np.arange(0, dh, 2) / dh)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def rope(x_bthd):
        x1, x2 = x_bthd[..., : dh // 2], x_bthd[..., dh // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    visible_ts = np.tril(np.ones((t, t), bool))
    x = w["embed/embedding"][np.asarray(tokens_bt)]
    for i in range(cfg.n_layers):
        blk = lambda name, i=i: w[f"blocks/{i}/{name}"]  # noqa: E731
        qkv = (rms(x, blk("attn_norm/scale")) @ blk("attn/qkv/kernel")).reshape(b, t, 3, h, dh)
        q, k, v = rope(qkv[:, :, 0]), rope(qkv[:, :, 1]), qkv[:, :, 2]
        z = np.where(visible_ts, np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dh), -np.inf)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        x = x + np.einsum("bhts,bshd->bthd", p, v).reshape(b, t, -1) @ blk("attn/out/kernel")
        u = rms(x, blk("mlp_norm/scale")) @ blk("mlp/up/kernel")
        gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
        x = x + gelu @ blk("mlp/down/kernel")
    head = w["embed/embedding"].T if cfg.tie_embeddings else w["head/kernel"]
    return rms(x, w["final_norm/scale"]) @ head


def compare(ref_btv, logits_btv, targets, mask) -> dict:
    """A row's logits against the reference's, in float64 over the masked held-out positions."""
    ref = np.asarray(ref_btv, np.float64)
    got = np.asarray(logits_btv, np.float64)
    m = np.asarray(mask, bool)
    lp_ref, lp = _log_softmax(ref), _log_softmax(got)
    kl = np.maximum(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1), 0.0)
    nll = -np.take_along_axis(lp, np.asarray(targets)[..., None], axis=-1)[..., 0]
    diff = np.max(np.abs(got - ref), axis=-1)
    agree = np.argmax(lp, -1) == np.argmax(lp_ref, -1)
    n = m.sum()
    return {
        "heldout_loss": float(nll[m].sum() / n),
        "max_abs_logit_diff": float(diff[m].max()),
        "mean_kl": float(kl[m].sum() / n),
        "greedy_agreement": float(agree[m].sum() / n),
        "positions": int(n),
    }


def check_fp32(row: dict) -> None:
    """The fp32 row must agree with the float64 reference to fp32 rounding, else the model (or the
    reference) computes something else and no row of the table means what it says."""
    if row["max_abs_logit_diff"] > FP32_TOL:
        raise TpulabError(
            f"the fp32 forward differs from the independent float64 reference by "
            f"{row['max_abs_logit_diff']:.3g} in a logit (allowed {FP32_TOL:g}, fp32 rounding): "
            "the model and the reference compute different functions, so no row would mean what "
            "it says"
        )


def _median_time(fn, *args, n: int = 20) -> float:
    import jax

    from tpulab.perf.timing import summarize, time_steps

    return summarize(time_steps(lambda: fn(*args), jax.block_until_ready, n, warmup=2))["median_s"]


def precision_table(
    run_dir: str | Path, *, windows: int = 8, train_steps: int = 20, time_emulated: bool = True
) -> dict:
    """``time_emulated=False``: on a CPU backend the bf16 training rows keep ``train_step_ms``
    None instead of timing a train step bf16 only emulates there (two compiles and 44 steps, about
    35 of the dossier's CPU-s on a shared 2-core host; the time says nothing about a TPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tpulab.data.tokenizer import PAD
    from tpulab.inference.cache_eval import _teacher_forced, heldout_windows
    from tpulab.model import kvcache as kv
    from tpulab.model.config import PrecisionConfig
    from tpulab.model.decode import ModelFns
    from tpulab.model.transformer import Transformer
    from tpulab.perf.bench import bench_step
    from tpulab.train.restore import load_model

    src = load_model(run_dir)
    if (
        src.config.precision.param_dtype != "float32"
        or src.config.precision.compute_dtype != "float32"
    ):
        raise TpulabError(
            f"{run_dir} was trained in {src.config.precision.param_dtype}/"
            f"{src.config.precision.compute_dtype}; the precision table needs an fp32 run"
        )
    win = heldout_windows(src.config, windows)
    inputs, targets = jnp.asarray(win[:, :-1]), win[:, 1:]
    mask = targets != PAD
    ref_fns = ModelFns(src.model)
    ref = reference_logits(ref_fns.params, src.config.model, np.asarray(inputs))
    n_params = sum(int(x.size) for x in ref_fns.params.values())
    rows = []
    for name in ROWS:
        w_dtype, act, acc, cache_policy = _POLICY[name]
        if name in ("bf16-compute", "bf16-params"):
            prec = PrecisionConfig(param_dtype=w_dtype, compute_dtype=act)
            model = nnx.eval_shape(
                lambda p=prec: Transformer(src.config.model, p, rngs=nnx.Rngs(0))
            )
            fns = ModelFns(model)
            params = {k: v.astype(fns.params[k].dtype) for k, v in ref_fns.params.items()}
            weight_bytes = sum(int(v.size) * v.dtype.itemsize for v in params.values())
        elif name == "int8-weights":
            fns = ref_fns
            params, weight_bytes = _int8_params(ref_fns.params)
        else:
            fns, params = ref_fns, ref_fns.params
            weight_bytes = n_params * 4
        fwd = jax.jit(fns.full_logits)
        if name == "int8-cache":
            prompt = max(1, inputs.shape[1] // 8)
            tf = jax.jit(lambda p, x, f=fns, n=prompt: _teacher_forced(f, "int8", p, x, n))
            logits = tf(params, inputs)
            fwd_s = _median_time(tf, params, inputs)
        else:
            logits = fwd(params, inputs)
            fwd_s = _median_time(fwd, params, inputs)
        row = {
            "policy": name,
            "weights": w_dtype,
            "activations": act,
            "accumulation": acc,
            "kv_cache": cache_policy,
            "weight_bytes": weight_bytes,
            "forward_ms": 1e3 * fwd_s,
            **compare(ref, logits, targets, mask),
        }
        abstract = jax.eval_shape(lambda c=cache_policy: ref_fns.shape.init(c, 1))
        row["kv_bytes_per_token"] = kv.bytes_per_token(abstract)
        emulated = act == "bfloat16" and jax.default_backend() == "cpu"
        if name in ("fp32", "bf16-compute", "bf16-params") and emulated and not time_emulated:
            row["train_step_ms"] = None  # a training row, not timed: bf16 is emulated here
        elif name in ("fp32", "bf16-compute", "bf16-params"):
            cfg = dataclasses.replace(
                src.config, precision=PrecisionConfig(param_dtype=w_dtype, compute_dtype=act)
            )
            row["train_step_ms"] = (
                1e3
                * bench_step(cfg, steps=train_steps, warmup=2, measure_matmul=False)["step_time"][
                    "median_s"
                ]
            )
        rows.append(row)
    check_fp32(rows[0])
    return {
        "rows": rows,
        "reference": "float64 NumPy forward of the same checkpoint (reference_logits), written "
        "from the architecture; every row, fp32 included, is compared with it",
        "checkpoint": {"step": src.step, "manifest_sha256": src.checkpoint_digest},
        "heldout": {"windows": list(inputs.shape), "positions": int(mask.sum())},
        "model": dataclasses.asdict(src.config.model),
    }


def markdown(result: dict) -> str:
    headers = ["policy", "weights", "activations", "accum", "KV cache", "held-out loss"]
    headers += ["max abs logit diff vs float64", "mean KL vs float64", "greedy agreement"]
    headers += ["weight MB", "KV B/token", "forward ms", "train step ms"]
    return table(
        headers,
        [
            (
                r["policy"],
                r["weights"],
                r["activations"],
                r["accumulation"],
                r["kv_cache"],
                f"{r['heldout_loss']:.4f}",
                f"{r['max_abs_logit_diff']:.2e}",
                f"{r['mean_kl']:.2e}",
                f"{r['greedy_agreement']:.4f}",
                f"{r['weight_bytes'] / 1e6:.3f}",
                f"{r['kv_bytes_per_token']:.0f}",
                f"{r['forward_ms']:.2f}",
                "inference only"
                if "train_step_ms" not in r
                else "not timed (bf16 emulated)"
                if r["train_step_ms"] is None
                else f"{r['train_step_ms']:.2f}",
            )
            for r in result["rows"]
        ],
    )


def write_precision(run_dir: str | Path, out_dir: str | Path | None = None, **kwargs) -> dict:
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.perf.timing import benchmark_environment

    result = precision_table(run_dir, **kwargs)
    result["environment"] = benchmark_environment()
    out = Path(out_dir) if out_dir else Path(run_dir) / "precision"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "precision.json", result)
    atomic_write_bytes(out / "precision.md", (markdown(result) + "\n").encode())
    return result
