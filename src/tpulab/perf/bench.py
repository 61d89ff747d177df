"""`tpulab bench`: the train step's compile, first step and steady state, against a matmul rate
measured here.

What is measured, in one process:

- compile: trace + lowering + XLA compile of the jitted train step on its first call (JAX's own
  monitoring events), apart from the rest of that first call (``first_step_s``) and from the
  steady state;
- steady state: at least ``MIN_TIMED_STEPS`` steps after warm-up, each synchronized with
  ``block_until_ready``; the host's waits on the device during those steps are counted at JAX's
  entry points (``tpulab.perf.timing.count_host_syncs``), so a hidden sync (a ``float(loss)`` in
  the loop) shows as a second sync per step;
- recompiles after warm-up, counted from XLA compile events (must be 0: ``check_no_recompiles``);
- FLOPs per step from XLA's cost analysis of the compiled step next to the analytic count
  (6 N tokens + attention, ``tpulab.perf.budget.train_flops``);
- the matmul rate of this host at the step's own GEMM shapes (forward, input-gradient and
  weight-gradient product of every Dense, the head and the attention products), measured in the
  same run, so utilization is a same-host ratio; a TPU's published peak is added only when JAX
  reports a TPU. A utilization above 100% of that rate is a measurement error (the reference ran
  slower than the step's own products: timed as dispatch, or the step ran its small products
  concurrently on several cores where the reference ran one at a time), never a result: it is
  reported as ``invalid`` and meets no target;
- the performance target of the step (``UTILIZATION_TARGETS``), judged on the raw utilization:
  69.74% misses a 70% target, whatever a rounded table shows.

Batches are fixed random token ids of the configured shape: step time does not depend on which
tokens they are, and the bench needs no corpus.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import figure, table
from tpulab.perf.timing import MIN_TIMED_STEPS, count_host_syncs, summarize
from tpulab.progress import progress

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig

DEFAULT_WARMUP = 3
# The step's performance target on the host it runs on: (smallest d_model, utilization of the matmul
# rate at its own shapes). Larger widths have larger GEMMs, which a step can keep busier.
UTILIZATION_TARGETS = ((256, 0.70), (0, 0.50))
MAX_UTILIZATION = 1.0  # above this the matmul reference, not the step, is what was mismeasured


class RecompileError(TpulabError):
    """The jitted step compiled again after warm-up (shape, dtype, sharding or weak-type change)."""


def utilization_target(d_model: int) -> float:
    return next(target for width, target in UTILIZATION_TARGETS if d_model >= width)


def utilization_verdict(result: dict) -> dict:
    """The target comparison of one bench result, made on the raw utilization (no rounding).

    ``invalid`` above ``MAX_UTILIZATION``: such a value is a measurement error and meets nothing."""
    raw = result.get("utilization_vs_matmul_rate")
    target = utilization_target(result["config"]["d_model"])
    if raw is None:
        verdict = "not measured"
    elif raw > MAX_UTILIZATION:
        verdict = "invalid"
    else:
        verdict = "met" if raw >= target else "missed"
    return {"utilization": raw, "target": target, "verdict": verdict}


def utilization_text(result: dict) -> str:
    """``69.74% (target >= 70%: missed)``: the raw value to two decimals and the verdict from it."""
    v = utilization_verdict(result)
    if v["utilization"] is None:
        return "-"
    what = (
        "INVALID: over 100% of the measured matmul rate is a measurement error"
        if v["verdict"] == "invalid"
        else v["verdict"]
    )
    return f"{100 * v['utilization']:.2f}% (target >= {100 * v['target']:.0f}%: {what})"


def synthetic_batch(config: RunConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t = config.data.batch_size, config.data.seq_len
    tokens = rng.integers(0, 256, size=(b, t + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((b, t), np.float32)}


def gemm_shapes(config: RunConfig) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """(name, lhs shape, rhs shape, count per step) of every matrix product in one train step."""
    m, b, t = config.model, config.data.batch_size, config.data.seq_len
    rows, d, hid, v, h, dh = (
        b * t,
        m.d_model,
        m.mlp_ratio * m.d_model,
        m.vocab_size,
        m.n_heads,
        m.head_dim,
    )
    out = []
    for name, k, n, count in (
        ("qkv", d, 3 * d, m.n_layers),
        ("out", d, d, m.n_layers),
        ("up", d, hid, m.n_layers),
        ("down", hid, d, m.n_layers),
        ("head", d, v, 1),
    ):
        out.append((f"{name} fwd", (rows, k), (k, n), count))
        out.append((f"{name} dgrad", (rows, n), (n, k), count))
        out.append((f"{name} wgrad", (k, rows), (rows, n), count))
    # attention: scores q.k^T and probs.v, forward and their two backward products each
    out.append(("attn scores/probs", (b * h, t, dh), (b * h, dh, t), 3 * m.n_layers))
    out.append(("attn values", (b * h, t, t), (b * h, t, dh), 3 * m.n_layers))
    return out


# Per call: (FLOPs that make call overhead small next to the arithmetic, most products batched into
# one call). CPU: 2e8 FLOPs is about 0.5 ms at 400 GFLOP/s. Accelerators: 2e11 is 0.2-0.5 ms at
# several hundred TFLOP/s against a dispatch of 10-50 us; with CPU-sized calls an H200's utilization
# read 186-273% (dispatch timed).
CALL_SIZE = {"cpu": (2e8, 64), "accelerator": (2e11, 4096)}


def matmul_rate(
    config: RunConfig, repeats: int = 15, dtype=None, max_bytes: float = 2 * 2**30
) -> dict:
    """FLOP/s of this backend on the step's own GEMM shapes (median time per shape, weighted by
    use).

    Small shapes are batched (``R`` independent products of the same shape in one call, a batched
    dot) so that one dispatch is shared by enough FLOPs (``CALL_SIZE``; at most ``max_bytes`` of
    operands): a lone 0.03 ms GEMM on a CPU, or a 1 us one on a GPU, would otherwise be timed mostly
    as call overhead, which the train step pays once per step, not once per GEMM. On an accelerator
    this is the rate the chip reaches at these shapes when given enough of them at once; a step
    that launches them one at a time reaches only part of it.
    """
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype or config.precision.compute_dtype)
    per_call, max_batch = CALL_SIZE["cpu" if jax.default_backend() == "cpu" else "accelerator"]
    mm = jax.jit(jnp.matmul)
    rows, total_flops, total_time = [], 0.0, 0.0
    key = jax.random.PRNGKey(0)
    for name, a_shape, b_shape, count in gemm_shapes(config):
        flops = 2.0 * np.prod(a_shape[:-1]) * a_shape[-1] * b_shape[-1]
        per_product = (
            np.prod(a_shape) + np.prod(b_shape) + np.prod(a_shape[:-1]) * b_shape[-1]
        ) * dtype.itemsize
        r = int(max(1, min(np.ceil(per_call / flops), max_batch, max_bytes // per_product)))
        ka, kb = jax.random.split(jax.random.fold_in(key, len(rows)))
        # R copies of one random product: separate buffers, filled by a copy rather than by the RNG
        a = _copies(jax.random.normal(ka, a_shape, dtype), r)
        b = _copies(jax.random.normal(kb, b_shape, dtype), r)
        mm(a, b).block_until_ready()
        med = _median_call_s(mm, a, b, repeats) / r
        rows.append(
            {
                "gemm": name,
                "lhs": list(a_shape),
                "rhs": list(b_shape),
                "count": count,
                "batched": r,
                "median_s": med,
                "flop_per_s": flops / med,
            }
        )
        total_flops += flops * count
        total_time += med * count
    return {
        "flop_per_s": total_flops / total_time,
        "gemm_flops_per_step": total_flops,
        "gemm_time_per_step_s": total_time,
        "dtype": dtype.name,
        "matmul_precision": str(jax.config.jax_default_matmul_precision or "default"),
        "shapes": rows,
        "method": "jit(jnp.matmul) per shape (R same-shape products per call, "
        f"R = {per_call:.0e} FLOPs / "
        f"product FLOPs, at most {max_batch}), median of {repeats} synchronized calls / R; "
        f"rate = sum(flops x count) / sum(time x count)",
    }


def _copies(x, r: int):
    import jax.numpy as jnp

    return jnp.broadcast_to(x, (r, *x.shape)).block_until_ready()  # a materialized [R, ...] buffer


def _median_call_s(fn, a, b, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_no_recompiles(result: dict) -> None:
    if result["recompiles_after_warmup"]:
        raise RecompileError(
            f"the train step compiled {result['recompiles_after_warmup']} more time(s) after "
            "warm-up; its inputs changed shape, dtype, sharding or weak type between steps"
        )


def bench_step(
    config: RunConfig,
    *,
    steps: int = MIN_TIMED_STEPS,
    warmup: int = DEFAULT_WARMUP,
    batch_fn: Callable[[int], dict] | None = None,
    measure_matmul: bool = True,
) -> dict:
    """Time the trainer's own jitted train step (``make_steps``) on this backend; see the module
    docstring.

    ``batch_fn(i)`` gives the host batch of timed step ``i`` (default: one fixed synthetic batch).
    """
    import jax

    from tpulab.compile_cache import count_compiles
    from tpulab.evidence.provenance import jax_devices
    from tpulab.model.config import matmul_params
    from tpulab.perf.budget import train_flops
    from tpulab.perf.chips import chip_for_device_kind
    from tpulab.train.step import make_steps

    if steps < MIN_TIMED_STEPS:
        raise TpulabError(f"--steps {steps}: a median needs at least {MIN_TIMED_STEPS} timed steps")
    fixed = synthetic_batch(config)
    batch_fn = batch_fn or (lambda i: fixed)
    s = make_steps(config)
    state = s.init()
    batch = s.put_batch(fixed)
    jax.block_until_ready((state, batch))

    with count_compiles() as first:
        t0 = time.perf_counter()
        state, metrics = s.train(state, batch)
        jax.block_until_ready((state, metrics))
        first_call_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        state, metrics = s.train(state, batch)
        jax.block_until_ready((state, metrics))

    mm_before = matmul_rate(config) if measure_matmul else None  # and after: drift hits both
    times = []
    with count_compiles() as steady, count_host_syncs() as syncs:
        for i in range(steps):
            b = s.put_batch(batch_fn(i))
            t0 = time.perf_counter()
            state, metrics = s.train(state, b)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
    loss = float(metrics["loss"])  # outside the timed loop: the one number this bench logs

    compiled = s.train.lower(
        s.abstract_state(),
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.batch_sharding), batch
        ),
    ).compile()
    cost = compiled.cost_analysis() or {}
    summary = summarize(times)
    tokens = config.data.batch_size * config.data.seq_len
    analytic = train_flops(config)
    env = jax_devices()
    result = {
        "config": _model_shape(config),
        "matmul_params": matmul_params(config.model),
        "compile_s": first["seconds"],
        "first_call_s": first_call_s,
        "first_step_s": max(first_call_s - first["seconds"], 0.0),
        "warmup_steps": warmup,
        "step_time": summary,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / summary["median_s"],
        "recompiles_after_warmup": steady["n"],
        "host_syncs_per_step": syncs.count / steps,
        "host_syncs_counted_at": list(syncs.entry_points),
        "final_loss": loss,
        "flops_per_step_compiler": float(cost.get("flops", 0.0)),
        "flops_per_step_analytic": analytic,
        "achieved_flop_per_s": analytic / summary["median_s"],
    }
    if measure_matmul:
        mm_after = matmul_rate(config)
        seconds = (mm_before["gemm_time_per_step_s"] + mm_after["gemm_time_per_step_s"]) / 2
        mm = {
            **mm_after,
            "flop_per_s": mm_after["gemm_flops_per_step"] / seconds,
            "gemm_time_per_step_s": seconds,
            "flop_per_s_before_after": [mm_before["flop_per_s"], mm_after["flop_per_s"]],
            "method": mm_after["method"]
            + "; measured before and after the timed steps, times averaged",
        }
        result["matmul"] = mm
        result["utilization_vs_matmul_rate"] = result["achieved_flop_per_s"] / mm["flop_per_s"]
        result["utilization_target"] = utilization_verdict(result)
    chip = chip_for_device_kind(env["device_kind"]) if env["backend"] == "tpu" else None
    if chip is not None:
        result["utilization_vs_chip_peak_bf16"] = result["achieved_flop_per_s"] / (
            chip.peak_bf16_flops * env["device_count"]
        )
    return result


def _model_shape(config: RunConfig) -> dict:
    m, p = config.model, config.precision
    return {
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "mlp_ratio": m.mlp_ratio,
        "vocab_size": m.vocab_size,
        "seq_len": config.data.seq_len,
        "batch_size": config.data.batch_size,
        "dropout": m.dropout,
        "param_dtype": p.param_dtype,
        "compute_dtype": p.compute_dtype,
    }


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not vals:
        raise TpulabError(f"--sweep expects KEY=v1,v2,..., got {spec!r}")
    return key.strip(), vals


def sweep_configs(
    load_config: Callable[[list[str]], object], spec: str
) -> list[tuple[str, object]]:
    """Every config of a sweep, all validated before anything runs (a bad value fails in one
    line)."""
    key, values = parse_sweep(spec)
    return [(v, load_config([f"{key}={v}"])) for v in values]


def sweep_table(key: str, rows: list[tuple[str, dict]]) -> str:
    headers = [key, "params (matmul)", "step median ms (p10-p90)", "tokens/s", "achieved GFLOP/s"]
    headers += ["matmul GFLOP/s at its shapes", "utilization (raw) and target", "recompiles"]
    cells = []
    for value, r in rows:
        st = r["step_time"]
        cells.append(
            (
                value,
                f"{r['matmul_params'] / 1e6:.2f}M",
                f"{1e3 * st['median_s']:.1f} ({1e3 * st['p10_s']:.1f}-{1e3 * st['p90_s']:.1f})",
                f"{r['tokens_per_s']:.0f}",
                f"{r['achieved_flop_per_s'] / 1e9:.1f}",
                f"{r['matmul']['flop_per_s'] / 1e9:.1f}",
                utilization_text(r),
                r["recompiles_after_warmup"],
            )
        )
    return table(headers, cells)


def summary_table(r: dict) -> str:
    st = r["step_time"]
    rows = [
        ("compile (trace + lower + XLA)", f"{r['compile_s']:.2f} s"),
        ("first step (after its compile)", f"{1e3 * r['first_step_s']:.1f} ms"),
        (
            f"steady step, median of {st['steps']} (p10-p90)",
            f"{1e3 * st['median_s']:.2f} ms ({1e3 * st['p10_s']:.2f}-{1e3 * st['p90_s']:.2f})",
        ),
        ("tokens/s", f"{r['tokens_per_s']:.0f}"),
        ("recompiles after warm-up", str(r["recompiles_after_warmup"])),
        ("host syncs per step (counted)", f"{r['host_syncs_per_step']:g}"),
        (
            "FLOPs/step: compiler cost analysis vs analytic 6N·tokens + attention",
            f"{r['flops_per_step_compiler'] / 1e9:.2f} G vs "
            f"{r['flops_per_step_analytic'] / 1e9:.2f} G",
        ),
        (
            "achieved (analytic FLOPs / median step)",
            f"{r['achieved_flop_per_s'] / 1e9:.1f} GFLOP/s",
        ),
    ]
    if "matmul" in r:
        rows.append(
            (
                "matmul rate here at the step's GEMM shapes",
                f"{r['matmul']['flop_per_s'] / 1e9:.1f} GFLOP/s",
            )
        )
        rows.append(("utilization vs that matmul rate", utilization_text(r)))
    if "utilization_vs_chip_peak_bf16" in r:
        rows.append(
            (
                "utilization vs the chip's published bf16 peak",
                f"{100 * r['utilization_vs_chip_peak_bf16']:.1f}%",
            )
        )
    return table(["measure", "value"], rows)


def run_bench(
    config: RunConfig,
    run_dir: str | Path,
    *,
    steps: int = MIN_TIMED_STEPS,
    sweep: list[tuple[str, object]] | None = None,
    sweep_key: str | None = None,
) -> dict:
    """Bench the config (or each config of a sweep) and write DIR/bench/bench.{json,md} (+ sweep
    plot)."""
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.config import to_dict
    from tpulab.perf.timing import benchmark_environment

    out = Path(run_dir) / "bench"
    main = bench_step(config, steps=steps)
    check_no_recompiles(main)
    result = {
        "bench": main,
        "config": to_dict(config),
        "environment": benchmark_environment(),
        "batches": "fixed synthetic token ids of the configured shape",
    }
    md = ["# bench", "", summary_table(main)]
    if sweep:
        rows, same = [], None
        for value, cfg in progress(sweep, f"bench sweep over {sweep_key}"):
            # the main config's row is the main bench, not a second one (~20 CPU-s at the
            # default size: the dossier's sweep 8,16 holds the config's own 16)
            r = main if cfg == config else bench_step(cfg, steps=steps)
            same = value if cfg == config else same
            check_no_recompiles(r)
            rows.append((value, r))
        result["sweep"] = {
            "key": sweep_key,
            "rows": [{"value": v, **r} for v, r in rows],
            "main_bench_row": same,
        }
        md += ["", f"## sweep over {sweep_key}", "", sweep_table(sweep_key, rows)]
        if same is not None:
            md += ["", f"The row {sweep_key}={same} is the main bench above (the same config)."]
        out.mkdir(parents=True, exist_ok=True)
        sweep_plot(sweep_key, rows, out / "sweep.png")
        md += ["", "![sweep](sweep.png)"]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "bench.json", result)
    atomic_write_bytes(out / "bench.md", ("\n".join(md) + "\n").encode())
    return result


def sweep_plot(key: str, rows: list[tuple[str, dict]], path: Path) -> None:
    labels = [v for v, _ in rows]
    with figure(path, ncols=3, figsize=(12, 3.6)) as (fig, axes):
        axes[0].plot(labels, [1e3 * r["step_time"]["median_s"] for _, r in rows], "o-")
        axes[0].set_ylabel("median step (ms)")
        axes[1].plot(labels, [r["tokens_per_s"] for _, r in rows], "o-")
        axes[1].set_ylabel("tokens/s")
        util = [100 * r["utilization_vs_matmul_rate"] for _, r in rows]
        axes[2].plot(labels, util, "o-", label="step (raw)")
        targets = [100 * utilization_verdict(r)["target"] for _, r in rows]
        axes[2].plot(labels, targets, "k_", ms=20, mew=2, ls="none", label="target")
        axes[2].axhline(100 * MAX_UTILIZATION, color="tab:red", ls=":", lw=1)
        axes[2].set_ylabel("% of matmul rate at own shapes")
        axes[2].set_ylim(0, max(105, 1.1 * max(util)))  # a value over 100% (invalid) stays visible
        axes[2].legend(fontsize=8)
        for ax in axes:
            ax.set_xlabel(key)
            ax.grid(alpha=0.3)
        fig.suptitle("train step vs size (same host, same run)")
