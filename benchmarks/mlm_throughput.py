"""Masked bytes against causal pretraining: train-step tokens/s at the same shapes, interleaved.

Both objectives' jitted, donated train steps (``MLM.build_steps`` with ``model.causal: false`` and
``make_steps``, pretraining's) are built from configs/mlm.yaml and configs/default.yaml (dropout 0:
the deterministic step) and fed the same numpy batches of the Grain pipeline. Compile and warm-up
steps are excluded; every timed step is synchronized; the two alternate in rounds (which goes
first alternates too), so a change in host load hits both; the median step of each gives its
tokens/s (batch x seq_len per step: a masked step reads every position, whatever it predicts).
The masked step includes drawing its masks on the device.

    .venv/bin/python benchmarks/mlm_throughput.py [--rounds 8] [--steps 5] [--set KEY=VALUE ...]

Writes benchmarks/results/mlm_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import jax

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.config import load, to_dict
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, train_dataset
from tpulab.evidence.report_kit import table
from tpulab.perf.timing import benchmark_environment, summarize, time_steps
from tpulab.process_setup import prepare
from tpulab.train.config import RunConfig
from tpulab.train.objectives.mlm import MLM
from tpulab.train.step import make_mesh, make_steps

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "mlm_throughput"
TARGET = 0.95  # masked tokens/s at least this share of causal's (issue 33)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per objective per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for both configs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    prepare()
    sets = ["model.dropout=0", *args.set]
    configs = {
        "causal": load(RunConfig, ROOT / "configs" / "default.yaml", sets),
        "masked": load(RunConfig, ROOT / "configs" / "mlm.yaml", sets),
    }
    shape = {k: getattr(configs["masked"].data, k) for k in ("batch_size", "seq_len")}
    for c in configs.values():
        assert {k: getattr(c.data, k) for k in shape} == shape and c.model.d_model == (
            configs["masked"].model.d_model
        ), "the two configs must share their shapes"
    cfg = configs["causal"]
    splits = build_splits(load_corpus(cfg.data.path), cfg.data)
    n = args.warmup + args.rounds * args.steps
    batches = list(itertools.islice(iter(train_dataset(splits.train_windows, cfg.data)), n))
    runners = {}
    for name, config in configs.items():
        mesh = make_mesh(config)
        steps = MLM.build_steps(config, mesh) if name == "masked" else make_steps(config, mesh)
        held = {"state": steps.init(), "batches": itertools.cycle(batches)}

        def step(steps=steps, held=held):
            held["state"], metrics = steps.train(
                held["state"], steps.put_batch(next(held["batches"]))
            )
            return metrics["loss"]

        time_steps(step, jax.block_until_ready, args.warmup)  # compile + warm-up, not timed
        runners[name] = step
    times = {name: [] for name in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name] += time_steps(runners[name], jax.block_until_ready, args.steps)
    tokens = shape["batch_size"] * shape["seq_len"]
    summary = {name: summarize(t) for name, t in times.items()}
    for s in summary.values():
        s["tokens_per_s"] = tokens / s["median_s"]
    ratio = summary["masked"]["tokens_per_s"] / summary["causal"]["tokens_per_s"]
    result = {
        "what": "train-step tokens/s, masked bytes (mlm, bernoulli) vs causal pretraining",
        "shapes": {**shape, "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers},
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "summary": summary,
        "masked_over_causal": ratio,
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "raw_step_s": times,
        "configs": {name: to_dict(c) for name, c in configs.items()},
        "environment": benchmark_environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), result)
    rows = [
        [name, f"{s['median_s'] * 1e3:.2f}", f"{s['p10_s'] * 1e3:.2f}", f"{s['p90_s'] * 1e3:.2f}",
         f"{s['tokens_per_s']:.0f}", str(s["steps"])]
        for name, s in summary.items()
    ]  # fmt: skip
    env = result["environment"]
    md = "\n".join(
        [
            "# Masked bytes vs causal pretraining: train-step throughput",
            "",
            table(["objective", "median ms", "p10 ms", "p90 ms", "tokens/s", "steps"], rows),
            "",
            f"masked / causal tokens/s: **{ratio:.3f}** (target >= {TARGET}: "
            f"{'met' if ratio >= TARGET else 'NOT met'})",
            "",
            f"Shapes: {result['shapes']}. CPU: {env['cpu'].get('model_name')}, "
            f"{env['cpu_count']} cores, load {env['load_avg_1m_5m_15m']}; backend "
            f"{env.get('backend')}; commit {env.get('git_commit')}.",
            "",
        ]
    )
    atomic_write_bytes(args.out.with_suffix(".md"), md.encode())
    print(json.dumps({"masked_over_causal": round(ratio, 4), "out": str(args.out)}))


if __name__ == "__main__":
    main()
