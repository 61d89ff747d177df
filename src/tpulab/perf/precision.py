"""`tpulab precision`: an explicit precision policy table for a trained run, measured against fp32.

Rows (weights / activations / accumulation / KV cache):

- ``fp32``: the reference;
- ``bf16-compute``: fp32 parameters, bf16 activations and matmul inputs (mixed precision training);
- ``bf16-params``: parameters and activations in bf16 (the optimizer moments would follow);
- ``int8-weights``: inference only; every matmul weight quantized symmetric per output channel
  (``scale = max|w| / 127`` per column of a Dense kernel, per row of the tied embedding), stored
  int8 and dequantized for the matmul;
- ``int8-cache``: fp32 weights, keys/values through the int8 KV cache (``inference.cache``),
  teacher-forced one token at a time.

Norms, softmax, logits and the loss stay fp32 in every row (``PrecisionConfig.accum_dtype``). Each
row: held-out loss, max |logit diff| and mean KL(fp32 || row) over held-out positions, greedy
agreement (the fraction of held-out positions whose argmax equals fp32's), bytes of the weights
(and cache bytes per token), the forward time on the held-out batch here, and for the training
rows the train step time here (``tpulab.perf.bench``). On a CPU bf16 is emulated, so bf16 times
here say nothing about a TPU, where bf16 is the MXU's native input.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tpulab.errors import TpulabError

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


def _compare(ref_btv, logits_btv, targets, mask) -> dict:
    import jax
    import jax.numpy as jnp

    lp_ref = jax.nn.log_softmax(ref_btv.astype(jnp.float32), axis=-1)
    lp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    m = jnp.asarray(mask)
    kl = jnp.maximum(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), axis=-1), 0.0)
    nll = -jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
    diff = jnp.max(jnp.abs(logits_btv.astype(jnp.float32) - ref_btv), axis=-1)
    agree = jnp.argmax(lp, -1) == jnp.argmax(lp_ref, -1)
    return {
        "heldout_loss": float(jnp.sum(nll * m) / m.sum()),
        "max_abs_logit_diff": float(jnp.max(jnp.where(m, diff, 0.0))),
        "mean_kl": float(jnp.sum(kl * m) / m.sum()),
        "greedy_agreement": float(jnp.sum(agree * m) / m.sum()),
        "positions": int(m.sum()),
    }


def _median_time(fn, *args, n: int = 20) -> float:
    import jax

    from tpulab.perf.timing import summarize, time_steps

    return summarize(time_steps(lambda: fn(*args), jax.block_until_ready, n, warmup=2))["median_s"]


def precision_table(run_dir, *, windows: int = 8, train_steps: int = 20) -> dict:
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
            f"{src.config.precision.compute_dtype}; the precision table needs an fp32 run as "
            "reference"
        )
    win = heldout_windows(src.config, windows)
    inputs, targets = jnp.asarray(win[:, :-1]), win[:, 1:]
    mask = targets != PAD
    ref_fns = ModelFns(src.model)
    full = jax.jit(ref_fns.full_logits)
    ref = full(ref_fns.params, inputs)
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
            tf = jax.jit(lambda p, x, fns=fns, n=prompt: _teacher_forced(fns, "int8", p, x, n))
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
            **_compare(ref, logits, targets, mask),
        }
        abstract = jax.eval_shape(lambda c=cache_policy: ref_fns.shape.init(c, 1))
        row["kv_bytes_per_token"] = kv.bytes_per_token(abstract)
        if name in ("fp32", "bf16-compute", "bf16-params"):
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
    return {
        "rows": rows,
        "checkpoint": {"step": src.step, "manifest_sha256": src.checkpoint_digest},
        "heldout": {"windows": list(inputs.shape), "positions": int(mask.sum())},
        "model": dataclasses.asdict(src.config.model),
    }


def markdown(result: dict) -> str:
    lines = [
        "| policy | weights | activations | accum | KV cache | held-out loss | max abs logit diff "
        "| mean KL | greedy agreement | weight MB | KV B/token | forward ms | train step ms |",
        "|" + "---|" * 13,
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['weights']} | {r['activations']} | {r['accumulation']} "
            f"| {r['kv_cache']} | {r['heldout_loss']:.4f} | {r['max_abs_logit_diff']:.2e} "
            f"| {r['mean_kl']:.2e} | {r['greedy_agreement']:.4f} | {r['weight_bytes'] / 1e6:.3f} "
            f"| {r['kv_bytes_per_token']:.0f} | "
            f"{r['forward_ms']:.2f} | "
            + (f"{r['train_step_ms']:.2f}" if "train_step_ms" in r else "inference only")
            + " |"
        )
    return "\n".join(lines)


def write_precision(run_dir, out_dir=None, **kwargs) -> dict:
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.perf.timing import benchmark_environment

    result = precision_table(run_dir, **kwargs)
    result["environment"] = benchmark_environment()
    out = Path(out_dir) if out_dir else Path(run_dir) / "precision"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "precision.json", result)
    atomic_write_bytes(out / "precision.md", (markdown(result) + "\n").encode())
    return result
