"""The preference chain at the default size, end to end: pretrain -> SFT -> sampled pairs -> reward
model and DPO, scored against the gold reward r* (``tpulab.data.preference``).

Every stage is the library call the CLI makes (``train``, ``make_pairs``, ``win_rate``) on
``configs/default.yaml`` (4 layers, d_model 128, seq 128, fp32). Reported: the pairs' gold-optimal
accuracy (the best any reward model can reach on their Bradley-Terry labels), the reward model's
held-out accuracy against it, DPO's held-out pair accuracy and the KL(ref || pi) it reached, and
the gold-reward win rate of DPO's greedy replies against SFT's on the held-out plays.

    .venv/bin/python benchmarks/preference_chain.py [--steps 300] [--train-prompts 2048]

Writes benchmarks/results/preference_chain.{md,json}; runs go to runs/bench-preference-chain.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.config import load
from tpulab.evidence.metrics import read_records
from tpulab.perf.timing import benchmark_environment
from tpulab.process_setup import prepare
from tpulab.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"


def last_eval(run: Path) -> dict:
    return [r for r in read_records(run) if r.get("event") == "eval"][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps of every training stage")
    ap.add_argument("--train-prompts", type=int, default=2048)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--rm-lr", type=float, default=1e-3)
    ap.add_argument("--dpo-lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    prepare()
    from tpulab.posttrain.pairs import PairsConfig, make_pairs
    from tpulab.posttrain.winrate import win_rate
    from tpulab.train.loop import train

    env = benchmark_environment()
    root = ROOT / "runs" / "bench-preference-chain"
    shutil.rmtree(root, ignore_errors=True)
    runs = {k: root / k for k in ("base", "sft", "pairs", "reward", "dpo")}
    seconds = {}
    steps = [f"train.steps={args.steps}", f"optim.schedule_steps={args.steps}"]

    def stage(name, fn):
        t0 = time.perf_counter()
        out = fn()
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
        return out

    def run(name, *sets):
        cfg = load(RunConfig, CONFIG, [*steps, *sets])
        return stage(name, lambda: train(cfg, runs[name], progress=False))

    run("base")
    run("sft", "objective.kind=sft", f"objective.init={runs['base']}")
    pairs = stage(
        "pairs",
        lambda: make_pairs(
            runs["sft"],
            runs["pairs"],
            PairsConfig(train_prompts=args.train_prompts, eval_prompts=args.eval_prompts),
        ),
    )
    pref = [f"objective.init={runs['sft']}", f"objective.data={runs['pairs']}"]
    run("reward", "objective.kind=reward", *pref, f"optim.lr={args.rm_lr}")
    run(
        "dpo",
        "objective.kind=dpo",
        *pref,
        f"optim.lr={args.dpo_lr}",
        f"objective.dpo.beta={args.beta}",
    )
    wins = stage("win_rate", lambda: win_rate(runs["dpo"], runs["sft"], args.eval_prompts))
    rm, dpo = last_eval(runs["reward"]), last_eval(runs["dpo"])
    dpo_first = next(r for r in read_records(runs["dpo"]) if r.get("step") == 1)
    res = {
        "steps": args.steps,
        "pairs": pairs["counts"],
        "pairs_identity": pairs["identity"],
        "reward": {
            "lr": args.rm_lr,
            "val_accuracy": rm["val_accuracy"],
            "val_gold_optimal_accuracy": rm["val_gold_optimal_accuracy"],
            "val_loss": rm["val_loss"],
        },
        "dpo": {
            "lr": args.dpo_lr,
            "beta": args.beta,
            "step1_loss": dpo_first["loss"],
            "step1_reward_margin_absmax": dpo_first["reward_margin_absmax"],
            "val_reward_accuracy": dpo["val_reward_accuracy"],
            "val_kl_ref": dpo["val_kl_ref"],
            "val_loss": dpo["val_loss"],
        },
        "win_rate": {k: wins[k] for k in ("prompts", "wins", "ties", "losses", "win_rate")},
        "gold_mean": wins["gold_mean"],
        "stop_rate": wins["stop_rate"],
        "samples": wins["replies"][:3],
        "seconds": seconds,
        "environment": env,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "preference_chain.json", res)
    md = markdown(res)
    atomic_write_bytes(args.out / "preference_chain.md", md.encode())
    print(md)


def markdown(res: dict) -> str:
    env, c, r, d, w = res["environment"], res["pairs"], res["reward"], res["dpo"], res["win_rate"]
    return "\n".join(
        [
            "# The preference chain (default size)",
            "",
            f"configs/default.yaml (4 layers, d_model 128, seq 128, fp32), {res['steps']} steps a "
            "stage: pretrain -> SFT -> `tpulab pairs` (two replies per prompt, temperature 1, "
            "Bradley-Terry labels on r*) -> reward model and DPO from the SFT run.",
            "",
            "| quantity | value |",
            "|---|---|",
            f"| sampled pairs: train / held-out | {c['train']['pairs']} / {c['eval']['pairs']} |",
            f"| gold-optimal accuracy, held-out pairs | {r['val_gold_optimal_accuracy']:.3f} |",
            f"| reward model held-out accuracy (lr {r['lr']:g}) | {r['val_accuracy']:.3f} |",
            f"| DPO step-1 loss / largest step-1 margin | {d['step1_loss']!r} / "
            f"{d['step1_reward_margin_absmax']!r} |",
            f"| DPO held-out pair accuracy (beta {d['beta']:g}, lr {d['lr']:g}) | "
            f"{d['val_reward_accuracy']:.3f} |",
            f"| DPO KL(ref \\|\\| pi) on held-out pairs, nats per reply | {d['val_kl_ref']:.3f} |",
            f"| gold win rate, DPO vs SFT greedy, {w['prompts']} held-out prompts | "
            f"{w['win_rate']:.3f} ({w['wins']} wins, {w['ties']} ties, {w['losses']} losses) |",
            f"| mean r*: DPO / SFT | {res['gold_mean']['policy']:.3f} / "
            f"{res['gold_mean']['against']:.3f} |",
            f"| stop rate: DPO / SFT | {res['stop_rate']['policy']:.3f} / "
            f"{res['stop_rate']['against']:.3f} |",
            "",
            "Stage seconds: " + ", ".join(f"{k} {v}" for k, v in res["seconds"].items()) + ".",
            "",
            f"Provenance: backend `{env['backend']}`, device kind `{env['device_kind']}` x"
            f"{env['device_count']}, {env['cpu_count']} CPU cores, load average at start "
            f"{env['load_avg_1m_5m_15m']}, at end {res['load_avg_at_end']}; "
            + ", ".join(f"{k} {v}" for k, v in env["packages"].items())
            + f"; commit `{env['git_commit']}`; {env['time_utc']}.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
