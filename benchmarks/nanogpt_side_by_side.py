"""`tpulab train` beside nanoGPT's own train.py at the identical config, alternating rounds.

Each round runs both contenders, each as a fresh process, the order alternating (nanoGPT first in
odd rounds), so a change in the host's load falls on both. nanoGPT is a public checkout whose path
is given (karpathy/nanoGPT; nothing of it is copied here): its ``train.py`` runs unmodified, in a
scratch directory holding its ``data/<dataset>/{train,val}.bin`` and ``meta.pkl`` written from
tpulab's own corpus and byte tokenizer (258 ids: each document is BOS then its bytes, the training
documents into train.bin, the held-out ones into val.bin), eager (``compile=False``), fp32, one
micro-step per iteration (``gradient_accumulation_steps=1``).

The shared config: 4 layers, 4 heads, d_model 128, block 128, batch 16 (2,048 tokens/step), vocab
258, AdamW b1 0.9, b2 0.99, weight decay 0.1, clip 1.0, lr 1e-3 with 50 warm-up steps and a cosine
to 1e-4 at step 600, dropout 0. Both evaluate once outside the timed window (nanoGPT at iteration
0, tpulab at its last step) and checkpoint only at the end (tpulab) or never (nanoGPT).

Timing, the same for both: the interval between consecutive steps' host-visible ends (nanoGPT's
own ``time`` per iteration, logged every iteration; tpulab's ``wall_s`` per step in metrics.jsonl,
read one step behind the dispatch). Steady state drops the first ``--skip`` steps (compile, first
steps, nanoGPT's iteration-0 eval); ms/step is the median interval, tokens/s is 2,048 over the
mean interval (so stalls count). Peak RSS: the process's own high-water mark from the kernel
(``wait4``'s ``ru_maxrss``) and the process tree's summed RSS sampled every 0.1 s (tpulab's
tracking helper is a child process).

Modes: ``native`` and ``avx2`` (``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` and
``ATEN_CPU_CAPABILITY=avx2`` for both contenders: the older host kind on any x86 host);
``--neighbour`` runs a process spinning on one core beside every run. The raw per-step intervals
go to ``OUT/results.json``, the tables to ``OUT/results.md``.

    .venv/bin/python benchmarks/nanogpt_side_by_side.py --nanogpt /path/to/nanoGPT \\
        [--steps 200] [--rounds 3] [--modes native avx2] [--neighbour] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.config import load
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import split_documents
from tpulab.data.tokenizer import BOS, VOCAB_SIZE
from tpulab.evidence.metrics import METRICS, read_records
from tpulab.evidence.report_kit import table
from tpulab.perf.process import run_measured
from tpulab.perf.timing import benchmark_environment
from tpulab.process_setup import prepare
from tpulab.proofs.driver import tpulab_argv
from tpulab.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
DATASET = "tpulab_bytes"
TOKENS_PER_STEP = 16 * 128
LR, MIN_LR, WARMUP, DECAY_STEPS = 1e-3, 1e-4, 50, 600
MODES = {
    "native": {},
    "avx2": {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
ITER_LINE = re.compile(r"^iter (\d+): loss ([-\d.naninf]+), time ([\d.]+)ms")


def tpulab_overrides(steps: int) -> list[str]:
    return [
        "model.dropout=0",
        f"optim.lr={LR}",
        f"optim.min_lr_ratio={MIN_LR / LR}",
        f"optim.warmup_steps={WARMUP}",
        f"optim.schedule_steps={DECAY_STEPS}",
        "optim.b2=0.99",
        "optim.weight_decay=0.1",
        "optim.clip_norm=1.0",
        f"train.eval_every={steps}",
        f"checkpoint.save_every={steps}",
    ]


def nanogpt_args(steps: int, out_dir: Path) -> list[str]:
    """nanoGPT's configurator takes ``--key=value``; ``max_iters`` is the last iteration run."""
    return [
        f"--out_dir={out_dir}",
        f"--dataset={DATASET}",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        "--n_layer=4",
        "--n_head=4",
        "--n_embd=128",
        "--block_size=128",
        "--batch_size=16",
        "--gradient_accumulation_steps=1",
        "--dropout=0.0",
        "--bias=False",
        f"--learning_rate={LR}",
        f"--min_lr={MIN_LR}",
        f"--warmup_iters={WARMUP}",
        f"--lr_decay_iters={DECAY_STEPS}",
        "--beta1=0.9",
        "--beta2=0.99",
        "--weight_decay=0.1",
        "--grad_clip=1.0",
        f"--max_iters={steps - 1}",
        f"--eval_interval={steps + 1}",
        "--eval_iters=8",
        "--log_interval=1",
        "--always_save_checkpoint=False",
        "--wandb_log=False",
    ]


def write_nanogpt_data(config: RunConfig, work: Path) -> dict:
    """tpulab's corpus split as tpulab splits it, each document BOS + bytes, as nanoGPT's uint16
    token files."""
    corpus = load_corpus(config.data.path)
    train_docs, val_docs = split_documents(corpus, config.data)
    data = work / "data" / DATASET
    data.mkdir(parents=True)
    counts = {}
    for name, docs in (("train", train_docs), ("val", val_docs)):
        ids = np.concatenate(
            [np.concatenate([[BOS], np.frombuffer(d.data, np.uint8)]) for d in docs]
        ).astype(np.uint16)
        ids.tofile(data / f"{name}.bin")
        counts[f"{name}_tokens"] = int(ids.size)
    atomic_write_bytes(data / "meta.pkl", pickle.dumps({"vocab_size": VOCAB_SIZE}))
    # nanoGPT's train.py reads configurator.py from its working directory
    (work / "configurator.py").symlink_to(NANOGPT / "configurator.py")
    return {"corpus_identity": corpus.identity, **counts}


def checked(res: dict, log: Path) -> dict:
    if res["returncode"] != 0:
        sys.exit(f"error: a run exited {res['returncode']}; see {log}")
    return res


def steady(intervals_s: list[float], skip: int) -> dict:
    xs = intervals_s[skip:]
    if len(xs) < 20:
        sys.exit(f"error: {len(xs)} steady-state steps after --skip {skip}; need at least 20")
    mean = statistics.fmean(xs)
    return {
        "ms_per_step": round(1e3 * statistics.median(xs), 2),
        "mean_ms": round(1e3 * mean, 2),
        "p90_ms": round(1e3 * sorted(xs)[int(0.9 * (len(xs) - 1))], 2),
        "tokens_per_s": round(TOKENS_PER_STEP / mean),
        "steady_steps": len(xs),
    }


def run_nanogpt(work: Path, steps: int, env: dict, skip: int, tag: str) -> dict:
    out = work / f"out-{tag}"
    log = work / f"nanogpt-{tag}.log"
    argv = [sys.executable, str(NANOGPT / "train.py"), *nanogpt_args(steps, out)]
    res = checked(run_measured(argv, cwd=work, env=env, log=log, timeout=40 * steps + 300), log)
    iters = [ITER_LINE.match(line) for line in log.read_text().splitlines()]
    iters = [m for m in iters if m]
    if len(iters) != steps:
        sys.exit(f"error: nanoGPT logged {len(iters)} iterations, expected {steps}; see {log}")
    dts = [float(m.group(3)) / 1e3 for m in iters]  # dt of iteration i: end(i-1) -> end(i)
    return {
        **res,
        **steady(dts[1:], skip - 1),
        "first_loss": float(iters[0].group(2)),
        "last_loss": float(iters[-1].group(2)),
        "intervals_ms": [round(1e3 * x, 3) for x in dts],
    }


def run_tpulab(work: Path, steps: int, env: dict, skip: int, tag: str, extra: list[str]) -> dict:
    run_dir = work / f"tpulab-{tag}" / "run"
    run_dir.parent.mkdir()
    argv = tpulab_argv(
        "train", "--run-dir", run_dir, "--config", CONFIG, "--steps", steps, "--no-progress"
    )
    for o in tpulab_overrides(steps) + extra:
        argv += ["--set", o]
    log = work / f"tpulab-{tag}.log"
    res = checked(run_measured(argv, cwd=work, env=env, log=log, timeout=40 * steps + 600), log)
    rows = [r for r in read_records(run_dir / METRICS) if "loss" in r and "step" in r]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        sys.exit(f"error: {run_dir / METRICS} does not hold steps 1..{steps}")
    walls = [r["wall_s"] for r in rows]
    intervals = [b - a for a, b in zip(walls, walls[1:], strict=False)]  # end(i) -> end(i+1)
    return {
        **res,
        **steady(intervals, skip - 1),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "intervals_ms": [round(1e3 * x, 3) for x in intervals],
    }


@contextlib.contextmanager
def neighbour(on: bool):
    """A process spinning on one core (pinned to the last), as a busy neighbour would."""
    if not on:
        yield None
        return
    code = "import os; os.sched_setaffinity(0, {os.cpu_count() - 1})\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def torch_capability(env: dict) -> str:
    """The kernel level PyTorch picks under ``env`` (proves ATEN_CPU_CAPABILITY took effect)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def markdown(result: dict) -> str:
    env, cfg = result["environment"], result["config"]
    lines = ["# tpulab train beside nanoGPT (eager), alternating rounds", ""]
    for mode, m in result["modes"].items():
        rows = []
        for r in m["rounds"]:
            n, t = r["nanogpt"], r["tpulab"]
            rows.append(
                [
                    str(r["round"]),
                    r["order"],
                    f"{r['load_avg_1m_before']:.2f}",
                    f"{n['ms_per_step']:.1f}",
                    f"{t['ms_per_step']:.1f}",
                    f"{n['tokens_per_s']:,}",
                    f"{t['tokens_per_s']:,}",
                    f"**{t['tokens_per_s'] / n['tokens_per_s']:.2f}x**",
                    f"{n['peak_rss_mib']:,.0f} / {t['peak_rss_mib']:,.0f}",
                    f"{n['tree_peak_rss_mib']:,.0f} / {t['tree_peak_rss_mib']:,.0f}",
                ]
            )
        lines += [
            f"## {mode}: {m['env_vars'] or 'no ISA limit'}; torch kernels {m['torch_capability']}",
            "",
            table(
                [
                    "round",
                    "order",
                    "load 1m",
                    "nanoGPT ms/step",
                    "tpulab ms/step",
                    "nanoGPT tok/s",
                    "tpulab tok/s",
                    "ratio (tok/s)",
                    "peak RSS MiB nanoGPT / tpulab",
                    "tree peak MiB",
                ],
                rows,
            ),
            "",
        ]
    cpu = env["cpu"]
    lines += [
        f"{cfg['steps']} steps per run, steady state from step {cfg['skip'] + 1} (compile, "
        "first steps and nanoGPT's iteration-0 eval excluded); ms/step is the median interval, "
        "tok/s 2,048 over the mean interval. "
        + ("A process spun on one core beside every run. " if cfg["neighbour"] else "")
        + f"Host: {cpu['model_name']} (family {cpu['family']} model {cpu['model']}; "
        f"{', '.join(cpu['isa'])}), {env['cpu_count']} cores; JAX backend {env['backend']} "
        f"({env['device_kind']}) x{env['device_count']}, not a TPU or GPU; "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
        + f"; nanoGPT {result['nanogpt_commit']}; commit `{env['git_commit']}`; "
        f"{env['time_utc']}; load at start {env['load_avg_1m_5m_15m']}.",
    ]
    return "\n".join(lines) + "\n"


def git_head(path: Path) -> str:
    argv = ["git", "-C", str(path), "rev-parse", "HEAD"]
    r = subprocess.run(argv, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main(argv=None) -> int:
    global NANOGPT
    prepare()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", required=True, type=Path, help="a karpathy/nanoGPT checkout")
    p.add_argument("--steps", type=int, default=200, help="steps per run (each a fresh process)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the steady state")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--neighbour", action="store_true", help="spin a process on one core beside")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra tpulab --set")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/nanogpt_side_by_side")
    p.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    args = p.parse_args(argv)
    NANOGPT = args.nanogpt.resolve()
    if not (NANOGPT / "train.py").is_file() or not (NANOGPT / "configurator.py").is_file():
        sys.exit(f"error: {args.nanogpt} is not a nanoGPT checkout (no train.py/configurator.py)")
    if args.steps < args.skip + 21:
        sys.exit(f"error: --steps {args.steps} leaves fewer than 20 steps after --skip")
    config = load(RunConfig, CONFIG, tpulab_overrides(args.steps) + args.sets)
    work = Path(args.work or tempfile.mkdtemp(prefix="nanogpt-sbs-"))
    if work.exists() and any(work.iterdir()):
        sys.exit(f"error: --work {work} is not empty")
    work.mkdir(parents=True, exist_ok=True)
    data = write_nanogpt_data(config, work)
    env0 = benchmark_environment(("torch",))
    result = {
        "config": {
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "neighbour": args.neighbour,
            "tpulab_overrides": tpulab_overrides(args.steps) + args.sets,
            "nanogpt_args": nanogpt_args(args.steps, Path("OUT")),
            "data": data,
        },
        "nanogpt_commit": git_head(NANOGPT),
        "environment": env0,
        "modes": {},
    }
    with neighbour(args.neighbour):
        for mode in args.modes:
            env = {**os.environ, **MODES[mode]}
            if "XLA_FLAGS" in MODES[mode] and os.environ.get("XLA_FLAGS"):
                env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {MODES[mode]['XLA_FLAGS']}"
            rounds = []
            for r in range(1, args.rounds + 1):
                order = ("nanogpt", "tpulab") if r % 2 else ("tpulab", "nanogpt")
                row = {"round": r, "order": " then ".join(order)}
                row["load_avg_1m_before"] = os.getloadavg()[0]
                for who in order:
                    tag = f"{mode}-{r}"
                    row[f"load_avg_before_{who}"] = [round(x, 2) for x in os.getloadavg()]
                    row[who] = (
                        run_nanogpt(work, args.steps, env, args.skip, tag)
                        if who == "nanogpt"
                        else run_tpulab(work, args.steps, env, args.skip, tag, args.sets)
                    )
                    print(f"{mode} round {r} {who}: {row[who]['ms_per_step']} ms/step", flush=True)
                row["ratio_tokens_per_s"] = round(
                    row["tpulab"]["tokens_per_s"] / row["nanogpt"]["tokens_per_s"], 3
                )
                rounds.append(row)
            result["modes"][mode] = {
                "env_vars": " ".join(f"{k}={v}" for k, v in MODES[mode].items()),
                "torch_capability": torch_capability(env),
                "rounds": rounds,
            }
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", result)
    md = markdown(result)
    atomic_write_bytes(args.out / "results.md", md.encode())
    print(md)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


NANOGPT = Path()

if __name__ == "__main__":
    sys.exit(main())
