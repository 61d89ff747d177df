"""Median steady-state time per training step of each bridge backend and method (same config).

Each (backend, method) trains in its own process through the real CLI (`tpulab bridge train`); the
trainer records the wall time of every step (forward, backward, optimizer, loss read back to the
host), excluding checkpoint writes. The first ``--warmup`` steps (compilation) are dropped and the
median of the rest is reported, with the provenance each run recorded.

    .venv/bin/python benchmarks/bridge_step_time.py [--steps 300] [--warmup 20] \
        [--out runs/bench-bridge]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from tpulab.bridge.config import BridgeConfig, runnable
from tpulab.bridge.prove import train_argv
from tpulab.bridge.report import device_line, start_record
from tpulab.checkpoint.files import atomic_write_json
from tpulab.config import to_dict
from tpulab.evidence.metrics import curve, read_records
from tpulab.evidence.report_kit import table
from tpulab.proofs.driver import run_to_completion


def render(result: dict) -> str:
    """The printed report of ``step_time.json``: what was timed, the table, the versions."""
    rows = result["rows"]
    v = rows[0]["versions"]
    return "\n".join(
        [
            f"{result['shapes']}, float32, {result['config']['steps']} steps, median after "
            f"{result['warmup_steps']} warmup steps",
            table(
                ["backend", "method", "median step (ms)", "p90 (ms)", "first step (s)", "device"],
                [
                    (
                        r["backend"],
                        r["method"],
                        f"{1e3 * r['median_step_s']:.3f}",
                        f"{1e3 * r['p90_step_s']:.3f}",
                        f"{r['first_step_s']:.2f}",
                        r["device"],
                    )
                    for r in rows
                ],
            ),
            f"versions: torch {v['torch']}, torchax {v['torchax']}, jax {v['jax']}, "
            f"jaxlib {v['jaxlib']}",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-bridge"))
    args = ap.parse_args(argv)
    cfg = BridgeConfig(steps=args.steps, checkpoint_every=args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for backend, method in runnable():
        d = args.out / f"{backend}-{method}"
        if d.exists():
            sys.exit(f"error: {d} exists; use a fresh --out")
        d.mkdir()
        run_to_completion(
            train_argv(cfg, backend, method, d),
            args.out / f"{backend}-{method}.log",
            dict(os.environ),
            900,
            f"{backend}/{method}",
        )
        times = curve(read_records(d), key="step_time_s")
        steady = [times[s] for s in sorted(times) if s > args.warmup]
        rec = start_record(d)
        rows.append(
            {
                "backend": backend,
                "method": method,
                "median_step_s": statistics.median(steady),
                "p90_step_s": sorted(steady)[int(0.9 * (len(steady) - 1))],
                "steps_timed": len(steady),
                "first_step_s": times[1],
                "device": device_line(rec["device"]),
                "device_kind": rec["device"].get("device_kind"),
                "dtype": rec["dtype"],
                "versions": rec["versions"],
            }
        )
    result = {
        "config": to_dict(cfg),
        "warmup_steps": args.warmup,
        "rows": rows,
        "shapes": f"x ({cfg.n}, {cfg.d}), MLP {cfg.d}->{cfg.hidden}->1, full batch",
    }
    atomic_write_json(args.out / "step_time.json", result)
    print(f"{render(result)}; written to {args.out / 'step_time.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
