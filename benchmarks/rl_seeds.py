"""`tpulab seeds` at configs/cartpole.yaml's documented size (PPO, 4 envs x 128 steps, 245 loop
steps of 4 updates = 501,760 env steps a seed): the wall time of the whole N-seed report (process
start, compiles, training, held-out scoring, bootstrap, report) with the seeds vmapped in one run,
and with them in sequence (one run a seed), and the env steps/s of each.

    python benchmarks/rl_seeds.py [--seeds 10] [--modes vmapped,sequence] [--set KEY=VALUE ...] \
        [--out benchmarks/results/rl_seeds]

Each mode is one `tpulab seeds` process (``perf.process.run_measured``: wall, CPU, peak RSS);
the modes run one after the other, vmapped first. env steps/s: all seeds' env steps over the
training wall (compiles included), and steady (between the first and the last logged step of each
run, compiles excluded). Prints a Markdown table; with --out writes OUT.json (raw: every mode's
seeds.json, the processes, provenance) and OUT.md. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _steady(run_dir: Path) -> tuple[float, float]:
    """(env steps, seconds) between the first and the last logged step of one run."""
    from tpulab.evidence.metrics import read_records

    steps = [r for r in read_records(run_dir) if "loss" in r]
    lanes = json.loads((run_dir / "env.json").read_text())["shapes"].get("seeds", 1)
    first, last = steps[0], steps[-1]
    return (last["env_steps"] - first["env_steps"]) * lanes, last["wall_s"] - first["wall_s"]


def _steps(v: float | None) -> str:
    return "never" if v is None else f"{v:,.0f}"


def _run_mode(mode: str, seeds: int, sets: list[str], work: Path) -> dict:
    from tpulab.perf.process import run_measured

    out = work / mode
    argv = [sys.executable, "-m", "tpulab.cli", "seeds", "--config", "configs/cartpole.yaml"]
    argv += ["--seeds", str(seeds), "--out", str(out)] + [x for s in sets for x in ("--set", s)]
    if mode == "sequence":
        argv.append("--sequence")
    proc = run_measured(argv, cwd=REPO, env=None, log=work / f"{mode}.log", timeout=3600)
    if proc["returncode"] != 0:
        raise SystemExit(f"{mode}: exit {proc['returncode']}; see {work / f'{mode}.log'}")
    record = json.loads((out / "seeds.json").read_text())
    runs = [out / "run"] if mode == "vmapped" else [out / f"seed{i}" for i in range(seeds)]
    steady = [_steady(r) for r in runs]
    return {
        "mode": mode,
        "process": proc,
        "seeds_json": record,
        "steady_env_steps_per_s": sum(s for s, _ in steady) / sum(t for _, t in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--modes", default="vmapped,sequence")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()
    from tpulab.evidence import report_kit
    from tpulab.evidence.provenance import describe_hardware
    from tpulab.perf.timing import benchmark_environment

    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="rl_seeds_") as tmp:
        rows = [_run_mode(m, args.seeds, args.sets, Path(tmp)) for m in args.modes.split(",")]
    env = benchmark_environment()
    head = (
        f"{describe_hardware(env)}; jax {env['packages']['jax']}; commit {env['git_commit']}; "
        f"`tpulab seeds --config configs/cartpole.yaml --seeds {args.seeds}` "
        f"{' '.join('--set ' + s for s in args.sets)}; load average {load_before} before, "
        f"{env['load_avg_1m_5m_15m']} after, on {os.cpu_count()} host cores"
    )
    table = report_kit.table(
        [
            "mode",
            "report wall s",
            "train s",
            "env steps/s (all)",
            "env steps/s (steady)",
            "IQM [95% CI]",
            "median steps to 475",
            "reached",
            "CPU s",
        ],
        [
            [
                r["mode"],
                f"{r['process']['wall_s']:.1f}",
                f"{r['seeds_json']['train_s']:.1f}",
                f"{r['seeds_json']['env_steps_per_s'] / 1e3:.0f}k",
                f"{r['steady_env_steps_per_s'] / 1e3:.0f}k",
                f"{r['seeds_json']['iqm']:.1f} [{r['seeds_json']['ci_low']:.1f}, "
                f"{r['seeds_json']['ci_high']:.1f}]",
                _steps(r["seeds_json"]["steps_to_475"]),
                f"{r['seeds_json']['reached']}/{args.seeds}",
                f"{r['process']['cpu_s']:.0f}",
            ]
            for r in rows
        ],
    )
    text = "\n".join([head, "", table]) + "\n"
    print(text, end="")
    if args.out:  # the raw numbers: every mode's seeds.json and process record, the provenance
        from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        raw = {"rows": rows, "args": vars(args) | {"out": str(args.out)}, "environment": env}
        atomic_write_json(args.out.with_suffix(".json"), raw | {"load_avg_before": load_before})
        atomic_write_bytes(args.out.with_suffix(".md"), text.encode())


if __name__ == "__main__":
    main()
