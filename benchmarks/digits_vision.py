"""The digits experiments at their documented sizes, each a fresh `tpulab` process, timed.

    python benchmarks/digits_vision.py [--seeds 5] [--out benchmarks/results/digits_vision]

1. `tpulab train --config configs/digits_cnn.yaml` (the supervised reference, one seed);
2. `tpulab train --config configs/digits_mae.yaml` (MAE pretraining, its audits);
3. `tpulab probe --encoder <2> --seeds S` (the linear probe, logistic regression on the pixels and
   S CNN runs, each with its 95% interval).

Each is measured by ``tpulab.perf.process.run_measured`` (wall, CPU, peak RSS). Writes OUT/
results.json (the raw measurements, the runs' final metrics and audits, probe.json's table,
provenance with the load average before and after each) and OUT/results.md. The runs themselves go
to a scratch dir (``--work``). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from tpulab.evidence.report_kit import table
from tpulab.perf.process import run_measured
from tpulab.perf.timing import benchmark_environment

REPO = Path(__file__).resolve().parents[1]


def tpulab(*args: str) -> list[str]:
    return [sys.executable, "-m", "tpulab.cli", *args]


def values(run: Path, key: str) -> list:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


def render(result: dict) -> str:
    """results.md from results.json: each experiment's wall, CPU and memory with the load average
    it started under, then the probe's table."""
    rows = [
        [name, f"{m['wall_s']:.1f}", f"{m['cpu_s']:.1f}", f"{m['peak_rss_mib']:.0f}"]
        + [" / ".join(f"{x:.1f}" for x in m["load_before"])]
        for name, m in result["measured"].items()
    ]
    accs = [
        [name, f"{m['accuracy_mean']:.4f}"]
        + [f"[{m['interval_95'][0]:.4f}, {m['interval_95'][1]:.4f}]", str(len(m["accuracies"]))]
        for name, m in result["probe"].items()
    ]
    env = result["environment"]
    head = f"# Digits experiments ({env['cpu'].get('model_name', '?')}, {env['cpu_count']} cores)"
    return "\n\n".join(
        [
            head,
            table(["experiment", "wall s", "CPU s", "peak RSS MiB", "load 1/5/15 m before"], rows),
            table(["model", "held-out accuracy", "95% interval", "seeds"], accs),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "digits_vision")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-digits-vision")
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cnn, mae, probe = args.work / "cnn", args.work / "mae", args.work / "probe"
    steps = {
        "digits_cnn": tpulab(
            "train", "--config", "configs/digits_cnn.yaml", "--run-dir", str(cnn), "--no-track"
        ),
        "digits_mae": tpulab(
            "train", "--config", "configs/digits_mae.yaml", "--run-dir", str(mae), "--no-track"
        ),
        "probe": tpulab(
            "probe", "--encoder", str(mae), "--seeds", str(args.seeds), "--out", str(probe)
        ),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    measured = {}
    for name, argv in steps.items():
        load_before = [round(x, 2) for x in os.getloadavg()]
        m = run_measured(argv, cwd=REPO, env=env, log=args.work / f"{name}.log", timeout=900)
        measured[name] = {**m, "load_before": load_before, "argv": argv[3:]}
        if m["returncode"] != 0:
            sys.exit(f"{name} failed: see {args.work / f'{name}.log'}")
    result = {
        "measured": measured,
        "digits_cnn": {
            "val_accuracy": values(cnn, "val_accuracy")[-1],
            "audits": json.loads((cnn / "audits.json").read_text()),
        },
        "digits_mae": {
            "val_loss": values(mae, "val_loss"),
            "loss_first_last": [values(mae, "loss")[0], values(mae, "loss")[-1]],
            "audits": json.loads((mae / "audits.json").read_text()),
        },
        "probe": json.loads((probe / "probe.json").read_text())["models"],
        "environment": benchmark_environment(),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
