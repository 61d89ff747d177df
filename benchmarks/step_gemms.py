"""The pretraining step's matrix products alone: XLA:CPU's kernels against PyTorch's, same shapes.

Each product of the default-config step (4 layers, d_model 128, MLP 512, batch 16 x 128 tokens,
4 heads of 32) is timed on its own, jitted (``jnp.einsum``) and in eager PyTorch
(``torch.einsum``), in one process, the two alternating in ``--rounds`` rounds (the best round's
median kept, so a burst of host load hits neither side alone), with ``--threads`` intra-op threads
for torch; JAX takes the CPUs the process may use (run under ``taskset -c 0`` for one thread).
``XLA_FLAGS`` is read as set (e.g. ``--xla_cpu_experimental_ynn_fusion_type=`` for Eigen's dots).
The step's whole GEMM work (count x FLOP of every product, forward and backward) at each side's
measured rate gives the lower bound a step built from these kernels cannot beat: is the gap to
nanoGPT in the kernels or in the rest of the step?

    taskset -c 0 .venv/bin/python benchmarks/step_gemms.py --threads 1 [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, T, D, F, H, V, LAYERS = 16, 128, 128, 512, 4, 258, 4
N, DH = B * T, D // H
# name: (lhs shape, rhs shape, einsum, how many in one train step: forward + the backward's two)
CASES = {
    "qkv x@W [2048,128]x[128,384]": ((N, D), (D, 3 * D), "ij,jk->ik", 3 * LAYERS),
    "out x@W [2048,128]x[128,128]": ((N, D), (D, D), "ij,jk->ik", 3 * LAYERS),
    "MLP up x@W [2048,128]x[128,512]": ((N, D), (D, F), "ij,jk->ik", 3 * LAYERS),
    "MLP down x@W [2048,512]x[512,128]": ((N, F), (F, D), "ij,jk->ik", 3 * LAYERS),
    "head x@E^T [2048,128]x[258,128]^T": ((N, D), (V, D), "ik,jk->ij", 3),
    "scores [64,128,32]x[64,128,32]^T": ((B * H, T, DH), (B * H, T, DH), "bid,bjd->bij", 12),
    "values [64,128,128]x[64,128,32]": ((B * H, T, T), (B * H, T, DH), "bij,bjd->bid", 12),
    "weight grad A^T G [2048,128]^T x[2048,512]": ((N, D), (N, F), "ij,ik->jk", 0),
}


def flops(sa, sb, eq) -> int:
    ins, out = eq.split("->")
    dims = dict(zip(ins.split(",")[0], sa, strict=True)) | dict(
        zip(ins.split(",")[1], sb, strict=True)
    )
    n = 2
    for c in set(ins.replace(",", "")):
        n *= dims[c]
    return n


def median_time(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    from tpulab.process_setup import prepare

    prepare()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.evidence.report_kit import table
    from tpulab.perf.timing import benchmark_environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30, help="timed calls per round and side")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step_gemms")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = benchmark_environment(("torch",))
    rng = np.random.default_rng(0)
    rows, raw, totals = [], {}, {"jax": 0.0, "torch": 0.0, "gflop": 0.0}
    for name, (sa, sb, eq, count) in CASES.items():
        a = rng.standard_normal(sa, dtype=np.float32)
        b = rng.standard_normal(sb, dtype=np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        f = jax.jit(lambda x, y, eq=eq: jnp.einsum(eq, x, y))
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        best = {"jax": [], "torch": []}
        sides = {
            "jax": lambda f=f, ja=ja, jb=jb: f(ja, jb).block_until_ready(),
            "torch": lambda eq=eq, ta=ta, tb=tb: torch.einsum(eq, ta, tb),
        }
        for _ in range(args.rounds):
            for side, fn in sides.items():
                best[side].append(median_time(fn, args.calls))
        j, t = min(best["jax"]), min(best["torch"])
        fl = flops(sa, sb, eq)
        raw[name] = {"flop": fl, "per_step": count, "jax_s": best["jax"], "torch_s": best["torch"]}
        totals["jax"] += count * j
        totals["torch"] += count * t
        totals["gflop"] += count * fl / 1e9
        rows.append(
            [
                name,
                str(count),
                f"{1e3 * j:.3f}",
                f"{fl / j / 1e9:.0f}",
                f"{1e3 * t:.3f}",
                f"{fl / t / 1e9:.0f}",
            ]
        )
        print(f"{name}: jax {1e3 * j:.3f} ms, torch {1e3 * t:.3f} ms", flush=True)
    result = {
        "config": {"threads": args.threads, "rounds": args.rounds, "calls": args.calls},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "environment": env,
        "cases": raw,
        "step_gemm_ms": {k: round(1e3 * totals[k], 2) for k in ("jax", "torch")},
        "step_gflop": round(totals["gflop"], 3),
    }
    tag = f"t{args.threads}_cpus{len(result['cpus_allowed'])}"
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / f"results_{tag}.json", result)
    cpu = env["cpu"]
    md = "\n".join(
        [
            f"# The step's GEMMs alone: XLA:CPU against PyTorch ({tag})",
            "",
            table(
                ["product", "per step", "XLA ms", "XLA GFLOP/s", "torch ms", "torch GFLOP/s"],
                rows,
            ),
            "",
            f"Every product of one train step ({totals['gflop']:.2f} GFLOP) at these rates: "
            f"XLA {1e3 * totals['jax']:.1f} ms, torch {1e3 * totals['torch']:.1f} ms. "
            f"CPUs allowed {result['cpus_allowed']}, torch threads {args.threads}, "
            f"XLA_FLAGS={result['xla_flags']!r}. Host: {cpu['model_name']} (family "
            f"{cpu['family']} model {cpu['model']}), {env['cpu_count']} cores, shared; load at "
            f"start {env['load_avg_1m_5m_15m']}, end {result['load_avg_end']}; commit "
            f"`{env['git_commit']}`; {env['time_utc']}.",
        ]
    )
    atomic_write_bytes(args.out / f"results_{tag}.md", (md + "\n").encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
