"""Steady-state training tokens/s of tpulab's train step against plain eager PyTorch, plus resume
start-up.

Part 1 (throughput, one process): tpulab's jitted, donated train step (``make_steps``) and an eager
PyTorch implementation of the identical model (tpulab's PyTorch twin, ``tpulab.bridge.twin``, loaded
through the conversion table) and optimizer train side by side on the same numpy
batches from the Grain pipeline, starting from the same parameters (tpulab's init, copied into
torch). Compile and warm-up steps are excluded; every timed step is synchronized
(``block_until_ready`` / ``loss.item()``); the two are timed in interleaved rounds, so a change in
host load hits both, and the median over at least 20 steps is reported. Agreement is checked on
the same run: the first-step loss (same parameters, same batch) must match to ~1e-5 relative.

Part 2 (resume start-up, subprocesses): a run trains to step 12 (checkpoints at 10 and 12); copies
of it are resumed to step 14 through the real CLI, with an empty compilation cache (cold) or the
cache the first run filled (warm). The time is wall clock from ``Popen`` to the first resumed
step's line in metrics.jsonl (interpreter start, imports, restore, compile, one step), polled
from the parent.

    .venv/bin/python benchmarks/train_throughput.py [--steps 21] [--resume-repeats 2]

Writes benchmarks/results/train_throughput.{md,json}; scratch runs go to
runs/bench-train-throughput.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from tpulab.bridge.convert import flat_params
from tpulab.bridge.convert_table import load_twin, to_torch
from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.config import load, to_dict
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, train_dataset
from tpulab.evidence.metrics import METRICS, read_records, starts
from tpulab.evidence.report_kit import table
from tpulab.model.transformer import NORM_EPS
from tpulab.perf.timing import benchmark_environment, summarize, time_steps
from tpulab.process_setup import prepare
from tpulab.proofs.driver import tpulab_argv
from tpulab.train.config import RunConfig
from tpulab.train.step import lr_schedule, make_steps

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
OVERRIDES = ["model.dropout=0"]  # the benchmark measures the deterministic step


# --- the PyTorch eager baseline: tpulab's PyTorch twin (tpulab.bridge.twin), trained ------------


def masked_xent(logits_btv, targets_bt, mask_bt):
    nll_bt = F.cross_entropy(
        logits_btv.flatten(0, 1), targets_bt.flatten(), reduction="none"
    ).view_as(mask_bt)
    return (nll_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1.0)


class TorchTrainer:
    """AdamW (decay on >= 2-D params only), the config's warmup-cosine schedule, global-norm
    clipping."""

    def __init__(self, config: RunConfig, params, lrs: np.ndarray):
        o = config.optim
        cfg = config.model
        self.model = load_twin(to_torch(flat_params(params), cfg), cfg, NORM_EPS, "tpulab's init")
        self.model.train()
        ps = list(self.model.parameters())
        groups = [
            {"params": [p for p in ps if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0},
        ]
        # fused=True: the fastest AdamW torch offers on CPU (one kernel over all params).
        self.opt = torch.optim.AdamW(
            groups, lr=float(lrs[0]), betas=(o.b1, o.b2), eps=o.eps, fused=True
        )
        self.clip, self.lrs, self.k = o.clip_norm, lrs, 0

    def step(self, batch):
        for g in self.opt.param_groups:  # what LambdaLR does, with optax's exact values
            g["lr"] = float(self.lrs[self.k])
        self.k += 1
        logits = self.model(torch.from_numpy(batch["inputs"]).long())
        loss = masked_xent(
            logits, torch.from_numpy(batch["targets"]).long(), torch.from_numpy(batch["mask"])
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return loss.detach()


# --- part 1: throughput ---------------------------------------------------------------------------


def throughput(config: RunConfig, n_steps: int, warmup: int, rounds: int) -> dict:
    splits = build_splits(load_corpus(config.data.path), config.data)
    total = warmup + n_steps
    batches = list(itertools.islice(iter(train_dataset(splits.train_windows, config.data)), total))
    lrs = np.asarray(jax.vmap(lr_schedule(config.optim))(jnp.arange(total)))

    steps = make_steps(config)
    state = steps.init()
    init_params = jax.device_get(state.params.to_pure_dict())  # before the first (donating) step
    cores = os.cpu_count()
    # Torch at the core count (the baseline) and at 1 thread: on a loaded host OpenMP's spinning
    # workers can make the multi-threaded run many times slower, which would flatter tpulab.
    torch_runs = (
        {"torch_eager": cores, "torch_eager_1thread": 1} if cores > 1 else {"torch_eager": 1}
    )
    out = {"tpulab": []} | {k: [] for k in torch_runs}
    runners = {}
    jit_batches = iter(batches)

    def jax_step():
        nonlocal state
        state, metrics = steps.train(state, steps.put_batch(next(jit_batches)))
        out["tpulab"].append(metrics)
        return state, metrics

    runners["tpulab"] = (jax_step, jax.block_until_ready, lambda: None)
    for name, threads in torch_runs.items():
        trainer, it = TorchTrainer(config, init_params, lrs), iter(batches)

        def torch_step(trainer=trainer, it=it, name=name):
            loss = trainer.step(next(it))
            out[name].append(loss)
            return loss

        runners[name] = (
            torch_step,
            torch.Tensor.item,
            lambda threads=threads: torch.set_num_threads(threads),
        )

    t0 = time.perf_counter()
    jax.block_until_ready(jax_step())  # compile (and the first step)
    compile_and_first_s = time.perf_counter() - t0
    for name, (step, sync, setup) in runners.items():
        setup()
        time_steps(step, sync, warmup - (name == "tpulab"))
    per_round = -(-n_steps // rounds)
    times = {name: [] for name in runners}
    for r in range(rounds):  # interleaved: host-load drift hits every implementation alike
        n = min(per_round, n_steps - r * per_round)
        for name, (step, sync, setup) in runners.items():
            setup()
            times[name] += time_steps(step, sync, n)
    torch.set_num_threads(cores)

    tokens = config.data.batch_size * config.data.seq_len
    jl = np.array([float(m["loss"]) for m in out["tpulab"]])
    tl = np.array([float(x) for x in out["torch_eager"]])
    rel = np.abs(jl - tl) / np.abs(jl)
    res = {
        "tokens_per_step": tokens,
        "warmup_steps": warmup,
        "timed_steps": n_steps,
        "rounds": rounds,
        "torch_threads": torch_runs,
    }
    for name, ts in times.items():
        s = summarize(ts)
        res[name] = {**s, "tokens_per_s": tokens / s["median_s"], "samples_s": ts}
    res["tpulab"]["compile_and_first_step_s"] = compile_and_first_s
    res["speedup"] = res["torch_eager"]["median_s"] / res["tpulab"]["median_s"]
    res["speedup_vs_fastest_torch"] = (
        min(res[k]["median_s"] for k in torch_runs) / res["tpulab"]["median_s"]
    )
    res["agreement"] = {
        "first_step_loss_tpulab": float(jl[0]),
        "first_step_loss_torch": float(tl[0]),
        "first_step_rel_diff": float(rel[0]),
        "max_rel_loss_diff_all_steps": float(rel.max()),
        "last_step_loss_tpulab": float(jl[-1]),
        "last_step_loss_torch": float(tl[-1]),
        "steps_compared": len(jl),
    }
    return res


# --- part 2: time from process start to the first resumed step -----------------------------------


def train_argv(run_dir: Path, cache: Path, steps: int) -> list[str]:
    argv = tpulab_argv(
        "train",
        "--run-dir",
        str(run_dir),
        "--config",
        str(CONFIG),
        "--steps",
        str(steps),
        "--compile-cache",
        str(cache),
        "--no-progress",
        "--set",
        "checkpoint.save_every=10",
    )
    for o in OVERRIDES:
        argv += ["--set", o]
    return argv


def run_logged(argv: list[str], log: Path, timeout: float = 300) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        sys.exit(f"error: {' '.join(argv)} exited {rc}; see {log}")


def timed_resume(base: Path, run_dir: Path, cache: Path, first_step: int, last_step: int) -> dict:
    """Copy ``base``, resume it in a fresh process; seconds from spawn to ``first_step``'s metrics
    line."""
    shutil.copytree(base, run_dir)
    segment = len(starts(read_records(run_dir)))
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            train_argv(run_dir, cache, last_step), stdout=f, stderr=subprocess.STDOUT
        )
        t_first, size = None, -1
        while t_first is None and proc.poll() is None:
            time.sleep(0.01)
            new_size = (run_dir / METRICS).stat().st_size
            if new_size != size:
                size = new_size
                if any(
                    r.get("step") == first_step and r.get("segment") == segment
                    for r in read_records(run_dir)
                ):
                    t_first = time.monotonic() - t0
        rc = proc.wait(timeout=300)
        t_exit = time.monotonic() - t0
    if rc != 0 or t_first is None:
        sys.exit(
            f"error: resume in {run_dir} exited {rc} before step {first_step} was logged; see {log}"
        )
    start = starts(read_records(run_dir))[segment]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "spawn_to_first_step_s": t_first,
        "in_process_to_first_step_s": summary["time_to_first_step_s"],
        "process_wall_s": t_exit,
        "resumed_from": start["resumed_from"],
    }


def resume_startup(work: Path, repeats: int, base_steps: int = 12, resume_to: int = 14) -> dict:
    base, warm_cache = work / "base", work / "cache-warm"
    run_logged(train_argv(base, warm_cache, base_steps), work / "base.log")
    trials = {"cold": [], "warm": []}
    for i in range(repeats):  # interleaved, so host-load drift hits both
        trials["cold"].append(
            timed_resume(
                base, work / f"cold-{i}", work / f"cache-cold-{i}", base_steps + 1, resume_to
            )
        )
        trials["warm"].append(
            timed_resume(base, work / f"warm-{i}", warm_cache, base_steps + 1, resume_to)
        )
    out = {"base_steps": base_steps, "resume_to": resume_to, "repeats": repeats, "trials": trials}
    for kind, rows in trials.items():
        if any(r["resumed_from"] != base_steps for r in rows):
            sys.exit(f"error: a {kind} resume did not start from checkpoint {base_steps}: {rows}")
        out[kind] = {
            k: statistics.median(r[k] for r in rows)
            for k in ("spawn_to_first_step_s", "in_process_to_first_step_s", "process_wall_s")
        }
    return out


# --- report --------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    t, env, c = result["throughput"], result["environment"], result["config"]
    a = t["agreement"]
    m, d = c["model"], c["data"]
    lines = [
        f"Shapes: {m['n_layers']} layers, {m['n_heads']} heads, d_model {m['d_model']}, "
        f"seq {d['seq_len']}, batch {d['batch_size']}, vocab {m['vocab_size']} (bytes), fp32, "
        "AdamW + warmup-cosine + clip "
        f"{c['optim']['clip_norm']}, dropout {m['dropout']}, same batches and same initial "
        "parameters. "
        f"Median of {t['timed_steps']} synchronized steps each "
        f"({t['rounds']} interleaved rounds) after {t['warmup_steps']} warm-up steps; "
        "compile excluded.",
        "",
    ]
    names = {
        "tpulab": "tpulab (jit, donated)",
        "torch_eager": f"PyTorch eager, {t['torch_threads']['torch_eager']} threads (baseline)",
        "torch_eager_1thread": "PyTorch eager, 1 thread (sensitivity)",
    }
    lines.append(
        table(
            ["implementation", "median step (ms)", "p10-p90 (ms)", "tokens/s", "vs torch eager"],
            [
                (
                    name,
                    f"{1e3 * t[key]['median_s']:.1f}",
                    f"{1e3 * t[key]['p10_s']:.1f}-{1e3 * t[key]['p90_s']:.1f}",
                    f"{t[key]['tokens_per_s']:,.0f}",
                    f"{t[key]['tokens_per_s'] / t['torch_eager']['tokens_per_s']:.2f}x",
                )
                for key, name in names.items()
                if key in t
            ],
        )
    )
    lines += [
        "",
        "Agreement (same init, same batches): first-step loss tpulab "
        f"{a['first_step_loss_tpulab']:.7f}, "
        f"torch {a['first_step_loss_torch']:.7f}, relative difference "
        f"{a['first_step_rel_diff']:.1e}; "
        f"max over all {a['steps_compared']} steps {a['max_rel_loss_diff_all_steps']:.1e}.",
        f"tpulab / torch baseline: **{t['speedup']:.2f}x**; against the faster torch setting: "
        f"{t['speedup_vs_fastest_torch']:.2f}x.",
        f"tpulab compile + first step: {t['tpulab']['compile_and_first_step_s']:.1f} s "
        "(not in the table).",
    ]
    if "resume" in result:
        r = result["resume"]
        lines += [
            "",
            f"Resume start-up (run trained to step {r['base_steps']}, resumed to "
            f"{r['resume_to']} by `tpulab train` "
            f"in a fresh process; median of {r['repeats']}):",
            "",
            table(
                [
                    "compilation cache",
                    "spawn to first resumed step (s)",
                    "in-process train() to first step (s)",
                    "whole process (s)",
                ],
                [
                    (
                        f"{kind} ({'empty dir' if kind == 'cold' else 'filled by an earlier run'})",
                        *(
                            f"{r[kind][k]:.2f}"
                            for k in (
                                "spawn_to_first_step_s",
                                "in_process_to_first_step_s",
                                "process_wall_s",
                            )
                        ),
                    )
                    for kind in ("cold", "warm")
                ],
            ),
        ]
    pk = env["packages"]
    lines += [
        "",
        f"Provenance: backend `{env['backend']}`, device kind `{env['device_kind']}` "
        f"x{env['device_count']}, "
        f"{env['cpu_count']} CPU cores, torch threads {result['torch_threads']} (baseline) "
        "and 1 (sensitivity row), "
        "load average at start "
        f"{env['load_avg_1m_5m_15m']}; "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if v)
        + f"; commit `{env['git_commit']}`; {env['time_utc']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=21, help="timed steps per implementation (>= 20)")
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (tpulab's include the compile)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument(
        "--resume-repeats", type=int, default=2, help="cold and warm resumes each (0 skips part 2)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-train-throughput")
    args = ap.parse_args(argv)
    if args.steps < 20 or args.warmup < 1:
        ap.error("--steps must be >= 20 and --warmup >= 1")
    prepare()  # as the CLI does, before JAX starts its threads or a backend

    config = load(RunConfig, CONFIG, OVERRIDES)
    torch.set_num_threads(os.cpu_count())
    env = benchmark_environment(("torch",))
    result = {
        "config": to_dict(config),
        "overrides": OVERRIDES,
        "torch_threads": os.cpu_count(),
        "environment": env,
        "dtype": config.precision.compute_dtype,
        "shapes": {
            "batch": config.data.batch_size,
            "seq": config.data.seq_len,
            "d_model": config.model.d_model,
            "n_layers": config.model.n_layers,
            "n_heads": config.model.n_heads,
            "vocab": config.model.vocab_size,
        },
        "throughput": throughput(config, args.steps, args.warmup, args.rounds),
    }
    if args.resume_repeats > 0:
        if args.work.exists():
            shutil.rmtree(args.work)
        args.work.mkdir(parents=True)
        result["resume"] = resume_startup(args.work, args.resume_repeats)
    env["load_avg_1m_5m_15m_end"] = [round(x, 2) for x in os.getloadavg()]

    md = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "train_throughput.json", result)
    atomic_write_bytes(
        args.out / "train_throughput.md", ("# Training throughput\n\n" + md).encode()
    )
    print(md, end="")
    print(f"written to {args.out / 'train_throughput.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
