"""`tpulab train`'s steady-state step against the bare jitted step at the same shapes, in one run.

Every variant is a fresh process, the order rotating per round so a change in the host's load
falls on all of them:

- ``bare``: this script's ``--bare`` child: ``process_setup.prepare`` as the CLI does, the
  pretraining objective's own data pipeline and ``make_steps`` train step, dispatch step N, then
  read step N-1's metrics to host floats (the loop's one-behind read) and stamp the time. No
  ledger, data contract, metrics file, hooks, eval, checkpoints or tracking. It also records its
  RSS after imports, after init, after the first step and at the end (the memory breakdown);
- ``bare_malloc``: the same with glibc's default allocator (no ``tpulab.hostmem``): what
  ``hostmem`` costs in RSS and saves in page faults (minor faults per steady step recorded);
- ``train``: ``tpulab train`` as shipped (tracking to a scratch sqlite store: a helper process;
  stall watchdog; eval every 50 steps; async checkpoints every 50);
- ``no_track``: the same with ``--no-track``;
- ``lean``: ``--no-track``, eval and checkpoint only at the last step: what is left is the
  ledger's hashing, the data contract, the metrics line, hooks and the watchdog;
- ``sync_save``: ``--no-track`` with ``checkpoint.async_save=false`` (the contrast for async).

Per-step interval: the time between consecutive steps' metrics reads (``wall_s`` in metrics.jsonl
for the loop, the child's own stamps for bare), first ``--skip`` steps dropped; the median is the
typical step, the mean counts eval and checkpoint stalls. Then, in this process, what the per-step
host work that cannot be switched off costs, each timed over ``--calls`` calls on a real batch:
the ledger's record (sha256 of every window), the data contract check, the metrics read and line.

    .venv/bin/python benchmarks/loop_overhead.py [--steps 200] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
OVERRIDES = ["model.dropout=0"]
VARIANTS = ("bare", "bare_malloc", "train", "no_track", "lean", "sync_save")
TOKENS_PER_STEP = 16 * 128


def rss_mib() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: round(int(fields[k].split()[0]) / 1024) for k in ("VmRSS", "VmHWM", "RssAnon")}


def bare(steps: int, out: Path, hostmem: bool) -> None:
    """The child: the jitted step fed by the objective's pipeline, nothing else."""
    import resource

    from tpulab.libtpu_env import quiet_libtpu_off_tpu
    from tpulab.process_setup import prepare

    prepare() if hostmem else quiet_libtpu_off_tpu()
    t_start = time.monotonic()
    stages = {"start": rss_mib()}
    import jax

    from tpulab.config import load
    from tpulab.train import objectives
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import host_metrics
    from tpulab.train.step import make_steps

    stages["imports"] = rss_mib()
    config = load(RunConfig, CONFIG, OVERRIDES + [f"train.steps={steps}"])
    data = objectives.build(config).data()
    it = data.train(0, 1)
    steps_ = make_steps(config)
    state = steps_.init()
    jax.block_until_ready(state)
    stages["init"] = rss_mib()
    stamps, pending = [], None
    for i in range(steps):
        batch = steps_.put_batch(next(it))
        state, metrics = steps_.train(state, batch)
        if pending is not None:
            host_metrics(pending)
            stamps.append(time.monotonic() - t_start)
        pending = metrics
        if i == 0:
            jax.block_until_ready(metrics)
            stages["first_step"] = rss_mib()
        if i == steps // 2:
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    host_metrics(pending)
    stamps.append(time.monotonic() - t_start)
    stages["end"] = rss_mib()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / (steps - steps // 2)
    out.write_text(json.dumps({"stamps_s": stamps, "rss_mib": stages, "minor_faults": faults}))


def intervals_summary(stamps: list[float], skip: int) -> dict:
    xs = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][skip - 1 :]
    if len(xs) < 20:
        sys.exit(f"error: {len(xs)} steady-state intervals after --skip {skip}; need 20")
    mean = statistics.fmean(xs)
    return {
        "median_ms": round(1e3 * statistics.median(xs), 2),
        "mean_ms": round(1e3 * mean, 2),
        "tokens_per_s": round(TOKENS_PER_STEP / mean),
        "intervals_ms": [round(1e3 * x, 3) for x in xs],
    }


def run_variant(name: str, work: Path, steps: int, skip: int, tag: str) -> dict:
    from tpulab.evidence.metrics import METRICS, read_records
    from tpulab.perf.process import run_measured
    from tpulab.proofs.driver import tpulab_argv

    d = work / f"{name}-{tag}"
    d.mkdir()
    if name.startswith("bare"):
        argv = [sys.executable, __file__, "--bare", "--steps", str(steps), "--json", str(d / "b")]
        argv += ["--no-hostmem"] if name == "bare_malloc" else []
    else:
        argv = tpulab_argv(
            "train", "--run-dir", d / "run", "--config", CONFIG, "--steps", steps, "--no-progress"
        )
        for o in OVERRIDES:
            argv += ["--set", o]
        if name != "train":
            argv.append("--no-track")
        if name == "lean":
            argv += [
                "--set",
                f"train.eval_every={steps}",
                "--set",
                f"checkpoint.save_every={steps}",
            ]
        if name == "sync_save":
            argv += ["--set", "checkpoint.async_save=false"]
    res = run_measured(argv, cwd=work, env=None, log=d / "log", timeout=30 * steps + 600)
    if res["returncode"] != 0:
        sys.exit(f"error: {name} exited {res['returncode']}; see {d / 'log'}")
    if name.startswith("bare"):
        child = json.loads((d / "b").read_text())
        stamps, res["rss_stages_mib"] = child["stamps_s"], child["rss_mib"]
        res["minor_faults_per_step"] = round(child["minor_faults"])
    else:
        rows = [r for r in read_records(d / "run" / METRICS) if "loss" in r and "step" in r]
        stamps = [r["wall_s"] for r in rows]
    if len(stamps) != steps:
        sys.exit(f"error: {name} recorded {len(stamps)} steps, expected {steps}")
    return {**res, **intervals_summary(stamps, skip)}


def host_costs(calls: int) -> dict:
    """Microseconds per call of the loop's per-step host work that no config switches off."""
    import jax.numpy as jnp

    from tpulab.config import load
    from tpulab.evidence.ledger import WindowLedger
    from tpulab.evidence.metrics import MetricsLog
    from tpulab.train import objectives
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import host_metrics

    config = load(RunConfig, CONFIG, OVERRIDES)
    data = objectives.build(config).data()
    batch = next(data.train(0, 1))
    metrics = {"loss": jnp.float32(2.5), "grad_norm": jnp.float32(1.0), "lr": jnp.float32(1e-3)}
    metrics["tokens"] = jnp.int32(2048)
    with tempfile.TemporaryDirectory() as tmp:
        ledger, log = WindowLedger(tmp), MetricsLog(tmp)
        cases = {
            "ledger.record_train (sha256 of 16 windows, one line)": lambda i: ledger.record_train(
                i, batch
            ),
            "data.check (the data contract)": lambda i: data.check(batch),
            "host_metrics (device scalars to floats)": lambda i: host_metrics(metrics),
            "MetricsLog.log (one JSON line)": lambda i: log.log(i, loss=2.5, grad_norm=1.0),
        }
        out = {}
        for name, fn in cases.items():
            times = []
            for i in range(calls):
                t0 = time.perf_counter()
                fn(i + 1)
                times.append(time.perf_counter() - t0)
            out[name] = round(1e6 * statistics.median(times), 1)
        ledger.close()
        log.close()
    return out


def markdown(result: dict) -> str:
    from tpulab.evidence.report_kit import table

    env, cfg = result["environment"], result["config"]
    lines = ["# `tpulab train` against the bare jitted step", ""]
    rows = []
    for r in result["rounds"]:
        base = r["bare"]["median_ms"]
        for name in cfg["variants"]:
            v = r[name]
            rows.append(
                [
                    str(r["round"]),
                    name,
                    f"{r['load_avg_1m'][name]:.2f}",
                    f"{v['median_ms']:.1f}",
                    f"{v['mean_ms']:.1f}",
                    f"{100 * (v['median_ms'] / base - 1):+.1f}%",
                    f"{v['tokens_per_s']:,}",
                    f"{v['peak_rss_mib']:,.0f}",
                    f"{v['tree_peak_rss_mib']:,.0f}",
                ]
            )
    head = ["round", "variant", "load 1m", "median ms", "mean ms", "median vs bare", "tok/s"]
    lines += [table(head + ["peak RSS MiB", "tree peak MiB"], rows), ""]
    lines += ["Per-step host work no switch removes (median µs per call, this process):", ""]
    lines += [table(["work", "µs"], [[k, f"{v:,.1f}"] for k, v in result["host_costs"].items()])]
    for name in [v for v in cfg["variants"] if v.startswith("bare")]:
        b = result["rounds"][0][name]
        lines += [
            "",
            f"`{name}` child RSS by stage (MiB, round 1; {b['minor_faults_per_step']:,} minor "
            "page faults per step over the second half):",
            "",
            table(
                ["stage", "VmRSS", "VmHWM", "RssAnon"],
                [
                    [k, str(v["VmRSS"]), str(v["VmHWM"]), str(v["RssAnon"])]
                    for k, v in b["rss_stages_mib"].items()
                ],
            ),
        ]
    cpu = env["cpu"]
    lines += [
        "",
        f"{cfg['steps']} steps per process, steady state from step {cfg['skip'] + 1}; config "
        f"configs/default.yaml with {', '.join(OVERRIDES)}. Host: {cpu['model_name']} (family "
        f"{cpu['family']} model {cpu['model']}; {', '.join(cpu['isa'])}), {env['cpu_count']} "
        f"cores, shared; JAX backend {env['backend']} ({env['device_kind']}) x"
        f"{env['device_count']}, not a TPU or GPU; "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
        + f"; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; commit `{env['git_commit']}`; "
        f"{env['time_utc']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=200, help="calls per host-work timing")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/loop_overhead")
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--no-hostmem", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bare:
        bare(args.steps, args.json, hostmem=not args.no_hostmem)
        return 0
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.perf.timing import benchmark_environment
    from tpulab.process_setup import prepare

    prepare()
    if args.steps < args.skip + 21:
        sys.exit(f"error: --steps {args.steps} leaves fewer than 20 steps after --skip")
    if "bare" not in args.variants:
        sys.exit("error: --variants must include bare (every ratio is against it)")
    env = benchmark_environment()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
        for r in range(args.rounds):
            names = (
                args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
            )
            row = {"round": r + 1, "order": names, "load_avg_1m": {}}
            for name in names:
                row["load_avg_1m"][name] = os.getloadavg()[0]
                row[name] = run_variant(name, Path(tmp), args.steps, args.skip, str(r))
                print(f"round {r + 1} {name}: {row[name]['median_ms']} ms median", flush=True)
            rounds.append(row)
    result = {
        "config": {
            "steps": args.steps,
            "skip": args.skip,
            "overrides": OVERRIDES,
            "variants": args.variants,
        },
        "environment": env,
        "rounds": rounds,
        "host_costs": host_costs(args.calls),
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", result)
    md = markdown(result)
    atomic_write_bytes(args.out / "results.md", md.encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
