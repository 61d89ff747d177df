"""The bare jitted train step under XLA:CPU thread settings, alone and beside a busy neighbour.

Each case is a fresh process of ``loop_overhead.py``'s bare child (the objective's pipeline and
``make_steps`` step, one-behind metric reads), the cases rotating per round: ``default`` (XLA's
intra-op pool sized to the CPUs the process may use), ``no_eigen_mt``
(``--xla_cpu_multi_thread_eigen=false``), ``one_cpu`` (affinity to one CPU, so XLA sizes every
pool to 1), each with ``--neighbour`` off and on (a process spinning on the last CPU for the whole
case). ``--isa avx2`` adds ``--xla_cpu_max_isa=AVX2``.

    .venv/bin/python benchmarks/step_threads.py [--steps 60] [--rounds 2] [--isa avx2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "default": ("", None),
    "no_eigen_mt": ("--xla_cpu_multi_thread_eigen=false", None),
    "one_cpu": ("", 0),
}


def main(argv=None) -> int:
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.evidence.report_kit import table
    from tpulab.perf.process import run_measured
    from tpulab.perf.timing import benchmark_environment
    from tpulab.process_setup import prepare

    prepare()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step_threads")
    args = p.parse_args(argv)
    if args.steps < args.skip + 21:
        sys.exit(f"error: --steps {args.steps} leaves fewer than 20 steps after --skip")
    env0 = benchmark_environment()
    names = [(c, nb) for c in CASES for nb in (False, True)]
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="step-threads-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for case, nb in order:
                flags, cpu = CASES[case]
                if args.isa == "avx2":
                    flags = f"{flags} --xla_cpu_max_isa=AVX2".strip()
                env = {**os.environ, "XLA_FLAGS": flags}
                out = Path(tmp) / f"{case}-{nb}-{r}.json"
                argv_ = [sys.executable, str(ROOT / "benchmarks" / "loop_overhead.py"), "--bare"]
                argv_ += ["--steps", str(args.steps), "--json", str(out)]
                if cpu is not None:
                    argv_ = ["taskset", "-c", str(cpu), *argv_]
                spinner = None
                if nb:
                    code = f"import os; os.sched_setaffinity(0, {{{os.cpu_count() - 1}}})\n"
                    spinner = subprocess.Popen([sys.executable, "-c", code + "while True: pass"])
                load = os.getloadavg()[0]
                try:
                    res = run_measured(
                        argv_, cwd=ROOT, env=env, log=Path(tmp) / "log", timeout=1800
                    )
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                if res["returncode"] != 0:
                    sys.exit(f"error: {case} exited {res['returncode']}")
                stamps = json.loads(out.read_text())["stamps_s"]
                xs = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][args.skip - 1 :]
                rec = {
                    "round": r + 1,
                    "case": case,
                    "neighbour": nb,
                    "xla_flags": flags,
                    "cpus": "all" if cpu is None else str(cpu),
                    "load_avg_1m_before": round(load, 2),
                    "median_ms": round(1e3 * statistics.median(xs), 2),
                    "mean_ms": round(1e3 * statistics.fmean(xs), 2),
                    "cpu_s": res["cpu_s"],
                    "intervals_ms": [round(1e3 * x, 3) for x in xs],
                }
                raw.append(rec)
                print(f"{case} neighbour={nb}: {rec['median_ms']} ms", flush=True)
                rows.append(
                    [
                        str(r + 1),
                        case,
                        "yes" if nb else "no",
                        f"{load:.2f}",
                        f"{rec['median_ms']:.1f}",
                        f"{rec['mean_ms']:.1f}",
                    ]
                )
    result = {"config": vars(args) | {"out": str(args.out)}, "environment": env0, "runs": raw}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / f"results_{args.isa}.json", result)
    cpu = env0["cpu"]
    md = "\n".join(
        [
            f"# Bare train step, XLA:CPU thread settings ({args.isa})",
            "",
            table(["round", "case", "neighbour", "load 1m", "median ms", "mean ms"], rows),
            "",
            f"{args.steps} steps per process, steady from step {args.skip + 1}. Host: "
            f"{cpu['model_name']} (family {cpu['family']} model {cpu['model']}), "
            f"{env0['cpu_count']} cores, shared; JAX backend {env0['backend']}, not a TPU or "
            f"GPU; commit `{env0['git_commit']}`; {env0['time_utc']}.",
        ]
    )
    atomic_write_bytes(args.out / f"results_{args.isa}.md", (md + "\n").encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
