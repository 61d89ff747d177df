"""SFT and LoRA speed: the SFT step against pretraining's, LoRA against full SFT, the merge.

Part 1 (one process): the SFT objective's jitted train step (from a base checkpoint, response-only
mask) and pretraining's (``make_steps``) at the same shapes (the default config: 4 layers,
d_model 128, batch 16 x seq 128, fp32, dropout 0), each on its own real batches (dialogue pairs,
corpus windows) prefetched to the host, timed step by step with a sync after each, in interleaved
rounds (ABBA order, so host-load drift hits both), medians reported. Tokens per step are the
batch's positions, 16 x 128 = 2,048, for both (SFT's loss covers fewer of them: its response
bytes, also reported; the compute is over every position).

Part 2 (a fresh process per variant and round): full SFT and LoRA (rank 8, alpha 16, every
projection) at d_model 256 and 512 (4 layers, 4 heads, seq 128, batch 16, fp32). Each process
records the median step time; its resident set after the imports and its peak resident set from
then on (the peak is reset after the imports, which alone peak at about 620 MiB: loading jax and
its plugins), next to the whole process's ``getrusage`` maxrss; the compiled step's
``memory_analysis()``; and the optimizer-state bytes.

Part 3 (a fresh process): ``tpulab.train.merge.merge_lora`` of a d_model 512 LoRA run, twice in the
same process: the first call pays the eager ops' compiles, the second does not; the merge itself
(``merge_seconds``: folding every adapter) is timed apart from the whole command (load, probe
logits, write).

    .venv/bin/python benchmarks/sft_speed.py [--steps 20] [--rounds 4] [--lora-steps 8]
    .venv/bin/python benchmarks/sft_speed.py --part merge     # one part: sft_speed_merge.{json,md}
    .venv/bin/python benchmarks/sft_speed.py --render benchmarks/results/sft_speed.json

Writes benchmarks/results/sft_speed.{json,md}; bases and scratch runs go to runs/bench-sft-speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tpulab.evidence.report_kit import table

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
FIXED = ["model.dropout=0"]  # the deterministic step, as train_throughput.py measures it
LORA = ["objective.lora.rank=8", "objective.lora.alpha=16"]
SIZES = (256, 512)
MET_RATIO = 0.95  # the bound: SFT tokens/s at least 0.95x pretraining's


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def status_mib(field: str) -> float | None:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the peak resident set (VmHWM) to the current one, so the peak measured afterwards is
    this variant's, not the imports' (loading jax and its plugins peaks higher than a small step
    ever does). Linux >= 4.0: ``5`` to /proc/self/clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def config(*sets: str):
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    return load(RunConfig, CONFIG, [*FIXED, *sets])


def sft_sets(base: Path, d_model: int | None = None, lora: bool = False) -> list[str]:
    sets = ["objective.kind=sft", f"objective.init={base}"]
    if d_model is not None:
        sets.append(f"model.d_model={d_model}")
    return sets + (LORA if lora else [])


def make_base(work: Path, d_model: int) -> Path:
    """A one-step pretraining run at ``d_model``: a base checkpoint of the benchmark's shapes (step
    time does not depend on what the weights hold)."""
    from tpulab.train.loop import train

    run = work / f"base-d{d_model}"
    if not (run / "summary.json").exists():
        shutil.rmtree(run, ignore_errors=True)
        sets = [f"model.d_model={d_model}", "train.steps=1", "checkpoint.save_every=1"]
        train(config(*sets, "train.eval_every=1", "train.eval_batches=1"), run, progress=False)
    return run


# --- part 1: SFT against pretraining, interleaved in one process -----------------------------


def sft_vs_pretrain(work: Path, n_steps: int, warmup: int, rounds: int) -> dict:
    import jax

    from tpulab.perf.timing import summarize, time_steps
    from tpulab.train.objectives.pretrain import Pretrain
    from tpulab.train.objectives.sft import SFT
    from tpulab.train.step import make_mesh

    base = make_base(work, 128)
    total = warmup + n_steps + 1
    runs = {}
    for name, cfg in (("pretrain", config()), ("sft", config(*sft_sets(base)))):
        objective = Pretrain(cfg) if name == "pretrain" else SFT(cfg)
        steps = objective.steps(make_mesh(cfg))
        batches = list(itertools.islice(objective.data().train(0, 1), total))
        runs[name] = {"steps": steps, "state": steps.init(), "batches": iter(batches)}
        runs[name]["response_tokens"] = [float(b["mask"].sum()) for b in batches]
    shapes = cfg.data

    def stepper(name):
        r = runs[name]

        def step():
            r["state"], metrics = r["steps"].train(
                r["state"], r["steps"].put_batch(next(r["batches"]))
            )
            return metrics

        return step

    first = {}
    for name in runs:  # compile and the first step, then warm-up
        t0 = time.perf_counter()
        jax.block_until_ready(stepper(name)())
        first[name] = time.perf_counter() - t0
        time_steps(stepper(name), jax.block_until_ready, warmup)
    times = {name: [] for name in runs}
    per_round = -(-n_steps // rounds)
    for r in range(rounds):
        order = ["pretrain", "sft"] if r % 2 == 0 else ["sft", "pretrain"]
        n = min(per_round, n_steps - r * per_round)
        for name in order:
            times[name] += time_steps(stepper(name), jax.block_until_ready, n)
    tokens = shapes.batch_size * shapes.seq_len
    out = {"tokens_per_step": tokens, "timed_steps": n_steps, "warmup_steps": warmup}
    out["rounds"] = rounds
    for name, ts in times.items():
        s = summarize(ts)
        out[name] = {
            **s,
            "tokens_per_s": tokens / s["median_s"],
            "compile_and_first_step_s": first[name],
            "samples_s": ts,
        }
    out["sft"]["mean_response_tokens_per_step"] = statistics.mean(runs["sft"]["response_tokens"])
    ratio = out["sft"]["tokens_per_s"] / out["pretrain"]["tokens_per_s"]
    out["ratio"] = ratio
    out["met"] = ratio >= MET_RATIO
    return out


# --- part 2: LoRA against full SFT, a fresh process per variant ------------------------------


def variant(base: Path, d_model: int, lora: bool, n_steps: int, warmup: int) -> dict:
    """One variant's measurements, in this (fresh) process."""
    import jax

    from tpulab.perf.timing import summarize, time_steps
    from tpulab.train.objectives.sft import SFT
    from tpulab.train.step import make_mesh

    maxrss_imports = maxrss_mib()
    rss_imports = status_mib("VmRSS")
    reset = reset_peak()

    cfg = config(*sft_sets(base, d_model, lora))
    objective = SFT(cfg)
    steps = objective.steps(make_mesh(cfg))
    state = steps.init()
    batches = iter(list(itertools.islice(objective.data().train(0, 1), warmup + n_steps + 1)))
    first_batch = steps.put_batch(next(batches))
    t0 = time.perf_counter()
    exe = steps.train.lower(state, first_batch).compile()  # the program steps.train runs
    compile_s = time.perf_counter() - t0
    mem = exe.memory_analysis()
    holder = {"state": state}

    def step(batch=None):
        b = first_batch if batch is not None else steps.put_batch(next(batches))
        holder["state"], metrics = exe(holder["state"], steps.frozen, b)
        return metrics

    jax.block_until_ready(step(first_batch))
    time_steps(step, jax.block_until_ready, warmup)
    times = time_steps(step, jax.block_until_ready, n_steps)
    s = holder["state"]
    return {
        "d_model": d_model,
        "variant": "lora" if lora else "full",
        "lora": {"rank": cfg.objective.lora.rank, "alpha": cfg.objective.lora.alpha}
        if lora
        else None,
        "trained_params": int(sum(x.size for x in jax.tree.leaves(s.params))),
        "frozen_params": int(sum(x.size for x in jax.tree.leaves(steps.frozen)))
        if steps.frozen is not None
        else 0,
        "optimizer_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(s.opt_state))),
        "compile_s": compile_s,
        "median_s": statistics.median(times),
        "samples_s": times,
        "summary": summarize(times, min_steps=1),
        "maxrss_after_imports_mib": maxrss_imports,  # getrusage: the process's peak so far
        "maxrss_peak_mib": maxrss_mib(),
        "rss_after_imports_mib": rss_imports,
        "peak_rss_since_imports_mib": status_mib("VmHWM") if reset else None,
        "peak_reset": reset,
        "memory_analysis": {
            k: int(getattr(mem, k))
            for k in (
                "argument_size_in_bytes",
                "output_size_in_bytes",
                "alias_size_in_bytes",
                "temp_size_in_bytes",
                "generated_code_size_in_bytes",
            )
        },
    }


def run_child(args: list[str], out_json: Path, log: Path, timeout: float = 1800) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), *args, "--json", str(out_json)]
    with open(log, "w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        sys.exit(f"error: {' '.join(argv)} exited {rc}; see {log}")
    return json.loads(out_json.read_text())


def lora_vs_full(work: Path, n_steps: int, warmup: int, rounds: int, sizes=SIZES) -> dict:
    rows = {}
    for d in sizes:
        base = make_base(work, d)
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for lora in order:
                tag = f"d{d}-{'lora' if lora else 'full'}-r{r}"
                args = ["--variant", "lora" if lora else "full", "--d-model", str(d)]
                args += ["--base", str(base), "--steps", str(n_steps), "--warmup", str(warmup)]
                res = run_child(args, work / f"{tag}.json", work / f"{tag}.log")
                rows.setdefault((d, res["variant"]), []).append(res)
    table = []
    for _, runs in sorted(rows.items()):
        samples = [t for r in runs for t in r["samples_s"]]
        table.append(
            {
                **{k: runs[0][k] for k in ("d_model", "variant", "lora", "trained_params")},
                "frozen_params": runs[0]["frozen_params"],
                "optimizer_state_bytes": runs[0]["optimizer_state_bytes"],
                "median_step_s": statistics.median(samples),
                "round_medians_s": [r["median_s"] for r in runs],
                "maxrss_peak_mib": max(r["maxrss_peak_mib"] for r in runs),
                "maxrss_after_imports_mib": max(r["maxrss_after_imports_mib"] for r in runs),
                "rss_after_imports_mib": max(r["rss_after_imports_mib"] or 0 for r in runs),
                "peak_rss_since_imports_mib": max(
                    r["peak_rss_since_imports_mib"] or 0 for r in runs
                ),
                "memory_analysis": runs[0]["memory_analysis"],
                "compile_s": [r["compile_s"] for r in runs],
                "runs": runs,
            }
        )
    by = {(r["d_model"], r["variant"]): r for r in table}
    faster = {d: by[(d, "full")]["median_step_s"] / by[(d, "lora")]["median_step_s"] for d in sizes}
    return {
        "rows": table,
        "lora_speedup": faster,
        "met": faster[512] > 1.0 if 512 in faster else None,
        "steps_per_run": n_steps,
        "rounds": rounds,
    }


# --- part 3: the merge at d_model 512 --------------------------------------------------------


def merge_child(lora_run: Path, work: Path) -> dict:
    """merge_lora twice in this fresh process: the first call pays the compiles."""
    from tpulab.train.merge import merge_lora

    calls = []
    for i in range(2):
        out = work / f"merged-{i}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        r = merge_lora(lora_run, out)
        calls.append(
            {
                "merge_s": r["merge_seconds"],
                "whole_command_s": time.perf_counter() - t0,
                "max_relative_logit_diff": r["max_relative_logit_diff"],
                "adapted_matrices": r["adapted_matrices"],
            }
        )
    return {"calls": calls}


def merge_bench(work: Path) -> dict:
    from tpulab.train.loop import train

    base = make_base(work, 512)
    run = work / "lora-d512"
    if not (run / "summary.json").exists():
        shutil.rmtree(run, ignore_errors=True)
        sets = sft_sets(base, 512, lora=True) + ["train.steps=2", "checkpoint.save_every=2"]
        train(config(*sets, "train.eval_every=2", "train.eval_batches=1"), run, progress=False)
    res = run_child(["--variant", "merge", "--base", str(run)], work / "merge.json", work / "m.log")
    first, second = res["calls"]
    from tpulab.train import merge

    kind = (
        "one jitted program (`tpulab.train.merge.folded`)"
        if hasattr(merge, "folded")
        else "eager ops (each compiles on first use)"
    )
    met = first["merge_s"] < 1.0 and second["merge_s"] < 1.0
    return {**res, "met": met, "merge_kind": kind}


# --- the report ------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    env = result["environment"]
    sp = result.get("sft_vs_pretrain")
    lines = ["# SFT and LoRA speed", ""]
    if sp:
        lines += [
            "## SFT step against the pretraining step (same shapes, same process, interleaved)",
            "",
            f"4 layers, 4 heads, d_model 128, batch 16 x seq 128 ({sp['tokens_per_step']:,} "
            "positions per step, the tokens counted for both), fp32, dropout 0; median of "
            f"{sp['timed_steps']} synchronized steps each in {sp['rounds']} ABBA rounds after "
            f"{sp['warmup_steps']} warm-up steps, compile excluded.",
            "",
            table(
                ["step", "median (ms)", "p10-p90 (ms)", "tokens/s", "compile + first step (s)"],
                [
                    (
                        name,
                        f"{1e3 * sp[name]['median_s']:.1f}",
                        f"{1e3 * sp[name]['p10_s']:.1f}-{1e3 * sp[name]['p90_s']:.1f}",
                        f"{sp[name]['tokens_per_s']:,.0f}",
                        f"{sp[name]['compile_and_first_step_s']:.1f}",
                    )
                    for name in ("pretrain", "sft")
                ],
            ),
            "",
            f"SFT / pretraining tokens/s: **{sp['ratio']:.3f}x** (bound {MET_RATIO}x: "
            f"**{'met' if sp['met'] else 'NOT met'}** by the raw value). SFT's loss covers "
            f"{sp['sft']['mean_response_tokens_per_step']:.0f} response bytes per step on average "
            "(of 2,048 positions).",
            "",
        ]
    lv = result.get("lora_vs_full")
    if lv:
        lines += [
            "## LoRA against full SFT",
            "",
            "4 layers, 4 heads, seq 128, batch 16, fp32, dropout 0; LoRA rank 8, alpha 16 on every "
            f"projection. A fresh process per variant and round ({lv['rounds']} rounds, "
            f"alternating order; {lv['steps_per_run']} timed steps each after warm-up); the step "
            "time is the median over every round's steps.",
            "",
            table(
                [
                    "d_model",
                    "variant",
                    "trained params",
                    "median step (s)",
                    "round medians (s)",
                    "optimizer state (MiB)",
                    "peak RSS after the imports (MiB)",
                    "RSS after the imports (MiB)",
                    "process peak RSS, getrusage (MiB)",
                    "step arguments, XLA (MiB)",
                    "step temporaries, XLA (MiB)",
                ],
                [
                    (
                        r["d_model"],
                        r["variant"],
                        f"{r['trained_params']:,}",
                        f"{r['median_step_s']:.3f}",
                        ", ".join(f"{x:.3f}" for x in r["round_medians_s"]),
                        f"{r['optimizer_state_bytes'] / 2**20:.2f}",
                        f"{r['peak_rss_since_imports_mib']:.0f}",
                        f"{r['rss_after_imports_mib']:.0f}",
                        f"{r['maxrss_peak_mib']:.0f}",
                        f"{r['memory_analysis']['argument_size_in_bytes'] / 2**20:.1f}",
                        f"{r['memory_analysis']['temp_size_in_bytes'] / 2**20:.1f}",
                    )
                    for r in lv["rows"]
                ],
            ),
            "",
            "LoRA step speed-up over full SFT: "
            + ", ".join(f"d_model {d}: **{x:.2f}x**" for d, x in lv["lora_speedup"].items())
            + ". LoRA the faster at d_model 512: "
            + {True: "**yes**", False: "**NO**", None: "not measured"}[lv["met"]]
            + ".",
            "",
            "Host memory: XLA's own accounting of the step (`memory_analysis`: arguments are the "
            "state, the frozen base and the batch; temporaries the activations kept for the "
            "backward pass) is the model's need. The resident set is the heap the process keeps: "
            "`tpulab.hostmem` tells glibc never to unmap or trim freed memory (a third of the "
            "step's time went to page faults without it), so it grows over the first steps to "
            "the largest heap they needed, fragmentation included (measured apart at d_model "
            "256: 573 MiB after the compile, 1,020 after 10 full steps, 1,304 after 10 LoRA "
            "steps). It ends larger for LoRA, whose step has more and differently sized "
            "temporaries (the adapters' activations), though XLA counts only 20-50 MiB more of "
            "them; which allocations make up the rest was not traced. The peak after the "
            "imports is reset there (`/proc/self/clear_refs`): loading jax alone peaks above a "
            "small step.",
            "",
        ]
    mg = result.get("merge")
    if mg:
        a, b = mg["calls"]
        lines += [
            "## Merging the adapters of a d_model 512 model",
            "",
            f"`tpulab.train.merge.merge_lora` on a rank-8 LoRA run ({a['adapted_matrices']} "
            "adapted matrices), twice in one fresh process.",
            "",
            table(
                [
                    "call",
                    "merge (folding every adapter, s)",
                    "whole command: load, probe, write (s)",
                    "max relative logit diff",
                ],
                [
                    (
                        i,
                        f"{c['merge_s']:.3f}",
                        f"{c['whole_command_s']:.2f}",
                        f"{c['max_relative_logit_diff']:.2e}",
                    )
                    for i, c in (("first (pays the compiles)", a), ("second", b))
                ],
            ),
            "",
            f"Under 1 s on both calls: **{'met' if mg['met'] else 'NOT met'}**. The merge is "
            f"{mg.get('merge_kind', 'eager ops (each compiles on first use)')}.",
            "",
        ]
    pk = env["packages"]
    lines += [
        f"Provenance: backend `{env['backend']}`, device kind `{env['device_kind']}` "
        f"x{env['device_count']}, {env['cpu_count']} CPU cores ({env.get('cpu_model', '?')}), "
        f"load average at start {env['load_avg_1m_5m_15m']} and at the end "
        f"{result['load_avg_end']} (the cores are shared); "
        + ", ".join(f"{k} {v}" for k, v in pk.items() if v)
        + f"; commit `{env['git_commit']}`; {env['time_utc']}; wall {result['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    from tpulab.process_setup import prepare

    prepare()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "speed", "lora", "merge"), default="all")
    p.add_argument("--steps", type=int, default=20, help="part 1: timed steps per step kind")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4, help="part 1: interleaved rounds")
    p.add_argument("--lora-steps", type=int, default=8, help="part 2: timed steps per process")
    p.add_argument("--lora-rounds", type=int, default=2, help="part 2: processes per variant")
    p.add_argument(
        "--sizes", default="256,512", help="part 2: d_model values (smaller ones: a smoke test)"
    )
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-sft-speed")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sft_speed")
    # one fresh process of part 2 or 3 (started by this script)
    p.add_argument("--variant", choices=("full", "lora", "merge"), help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=int, help=argparse.SUPPRESS)
    p.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--render", type=Path, help="rewrite the .md of this results .json and exit")
    args = p.parse_args()
    if args.render is not None:
        md = markdown(json.loads(args.render.read_text()))
        args.render.with_suffix(".md").write_text(md)
        print(md)
        return
    if args.variant is not None:
        if args.variant == "merge":
            res = merge_child(args.base, args.json.parent)
        else:
            lora = args.variant == "lora"
            res = variant(args.base, args.d_model, lora, args.steps, args.warmup)
        args.json.write_text(json.dumps(res, indent=1))
        return

    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.perf.timing import benchmark_environment

    args.work.mkdir(parents=True, exist_ok=True)
    env = benchmark_environment()
    env["cpu_model"] = cpu_model()
    t0 = time.monotonic()
    result = {"environment": env}
    if args.part in ("all", "speed"):
        result["sft_vs_pretrain"] = sft_vs_pretrain(args.work, args.steps, args.warmup, args.rounds)
        print(f"SFT / pretraining tokens/s: {result['sft_vs_pretrain']['ratio']:.3f}x", flush=True)
    if args.part in ("all", "lora"):
        sizes = tuple(int(x) for x in args.sizes.split(","))
        result["lora_vs_full"] = lora_vs_full(
            args.work, args.lora_steps, 1, args.lora_rounds, sizes
        )
        print(f"LoRA speed-up: {result['lora_vs_full']['lora_speedup']}", flush=True)
    if args.part in ("all", "merge"):
        result["merge"] = merge_bench(args.work)
        print(f"merge: {result['merge']['calls']}", flush=True)
    import os

    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = time.monotonic() - t0
    suffix = "" if args.part == "all" else f"_{args.part}"
    out = args.out.with_name(args.out.name + suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), result)
    atomic_write_bytes(out.with_suffix(".md"), markdown(result).encode())
    print(markdown(result))


if __name__ == "__main__":
    main()
