"""`tpulab convert` at the default size, both ways, each with its per-layer table and greedy check.

A default-config run (configs/default.yaml, ``--steps`` steps, dropout as configured) is trained
once; then, in alternating rounds, ``tpulab convert --run-dir RUN --to torch`` and ``tpulab convert
--from torch FILE`` run as fresh processes, each timed from spawn to exit (wall and CPU seconds,
peak RSS: ``perf.process.run_measured``), with the command's own in-process seconds (after its
imports) read from what it printed. Medians over ``--rounds``; provenance beside them.

    .venv/bin/python benchmarks/convert_speed.py [--steps 20] [--rounds 3] [--out DIR]

Writes DIR/convert_speed.{json,md} (default benchmarks/results/, tracked); scratch in --work.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.evidence.report_kit import table
from tpulab.perf.process import run_measured
from tpulab.perf.timing import benchmark_environment
from tpulab.process_setup import prepare
from tpulab.proofs.driver import tpulab_argv

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
DONE = re.compile(r"^converted (\S+) -> (\S+): .*; ([\d.]+) s -> ", re.M)


def timed(argv: list[str], log: Path) -> dict:
    res = run_measured(argv, cwd=ROOT, env=None, log=log, timeout=600)
    text = log.read_text()
    m = DONE.search(text)
    if res["returncode"] != 0 or m is None:
        sys.exit(f"error: {' '.join(map(str, argv))} exited {res['returncode']}; see {log}")
    return {**res, "in_process_s": float(m.group(3)), "table": text}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps of the default run")
    ap.add_argument("--rounds", type=int, default=3, help="conversions each way")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-convert")
    args = ap.parse_args(argv)
    prepare()
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    run = args.work / "run"
    train = tpulab_argv(
        *("train", "--run-dir", run, "--config", CONFIG, "--steps", args.steps, "--no-track"),
        *("--no-progress", "--set", f"checkpoint.save_every={args.steps}"),
    )
    if run_measured(train, cwd=ROOT, env=None, log=args.work / "train.log", timeout=1800)[
        "returncode"
    ]:
        sys.exit(f"error: training failed; see {args.work / 'train.log'}")
    env = benchmark_environment(("torch",))
    rows = {"to_torch": [], "from_torch": []}
    for r in range(args.rounds):
        pt, back = args.work / f"t{r}.pt", args.work / f"back{r}"
        to = tpulab_argv("convert", "--run-dir", run, "--to", "torch", "--out", pt)
        rows["to_torch"].append(timed(to, args.work / f"to{r}.log"))
        frm = tpulab_argv("convert", "--from", "torch", pt, "--out", back)
        rows["from_torch"].append(timed(frm, args.work / f"from{r}.log"))
    env["load_avg_1m_5m_15m_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = {
        k: {
            m: statistics.median(x[m] for x in v)
            for m in ("wall_s", "cpu_s", "in_process_s", "peak_rss_mib")
        }
        for k, v in rows.items()
    }
    result = {
        "config": str(CONFIG.relative_to(ROOT)),
        "train_steps": args.steps,
        "rounds": args.rounds,
        "summary": summary,
        "raw": {k: [{m: x[m] for m in x if m != "table"} for x in v] for k, v in rows.items()},
        "environment": env,
    }
    md = markdown(result, rows["to_torch"][0]["table"])
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "convert_speed.json", result)
    atomic_write_bytes(args.out / "convert_speed.md", md.encode())
    print(md, end="")
    return 0


def markdown(result: dict, first_table: str) -> str:
    s, env = result["summary"], result["environment"]
    cells = [
        (
            name,
            f"{s[key]['wall_s']:.2f}",
            f"{s[key]['cpu_s']:.2f}",
            f"{s[key]['in_process_s']:.2f}",
            f"{s[key]['peak_rss_mib']:.0f}",
        )
        for key, name in (("to_torch", "tpulab -> torch"), ("from_torch", "torch -> tpulab"))
    ]
    head = [
        "conversion",
        "process wall (s)",
        "process CPU (s)",
        "after imports (s)",
        "peak RSS MiB",
    ]
    pk = env["packages"]
    return (
        "# tpulab convert at the default size\n\n"
        f"configs/default.yaml trained {result['train_steps']} steps; each conversion a fresh "
        "`tpulab convert` process with its per-layer table over 8 held-out windows and the greedy "
        f"check (4 prompts); median of {result['rounds']} rounds, alternating.\n\n"
        + table(head, cells)
        + f"\n\nProvenance: CPU {env['cpu'].get('model_name')}, {env['cpu_count']} cores, backend "
        f"`{env['backend']}`; load average {env['load_avg_1m_5m_15m']} at start, "
        f"{env['load_avg_1m_5m_15m_end']} at end; "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if v)
        + f"; commit `{env['git_commit']}`; {env['time_utc']}.\n\n"
        "The first round's output (tpulab -> torch):\n\n```\n" + first_table.strip() + "\n```\n"
    )


if __name__ == "__main__":
    sys.exit(main())
