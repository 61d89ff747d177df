"""Data parallel against FSDP on 4 host devices: collectives in the compiled step, per-device
memory, step time.

For each mesh ({data: 4, fsdp: 1} = data parallel, {data: 2, fsdp: 2}, {data: 1, fsdp: 4} = FSDP)
the one train step (tpulab.train.step.make_steps, the sharding table of tpulab.train.sharding) is
lowered and compiled for the same global batch; from the compiled HLO every collective is counted
by kind with the bytes of its result per device (``tpulab.perf.aot.collectives``; all-gather: the
gathered array; reduce-scatter: the shard; all-reduce: the whole array). ``memory_analysis()``
gives the per-device argument (state + batch), output and temporary bytes; the state's own
per-device bytes are also summed from the shardings. The step is then timed (median of
synchronized steps after warm-up). CPU host devices share one memory and two cores, so the times
say little about a TPU slice; the collective counts and bytes carry over.

    .venv/bin/python benchmarks/scaleout_comm.py [--steps 20] [--warmup 3]

Writes benchmarks/results/scaleout_comm.{md,json}.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tpulab.process_setup import prepare  # noqa: E402

prepare()  # as the CLI does, before JAX starts its threads or a backend

import argparse  # noqa: E402
import itertools  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json  # noqa: E402
from tpulab.config import load, to_dict  # noqa: E402
from tpulab.data.corpus import load_corpus  # noqa: E402
from tpulab.data.pipeline import build_splits, train_dataset  # noqa: E402
from tpulab.evidence.report_kit import table  # noqa: E402
from tpulab.perf.aot import collectives  # noqa: E402  (one parser for CPU and TPU HLO)
from tpulab.perf.timing import benchmark_environment, summarize, time_steps  # noqa: E402
from tpulab.train.config import MeshConfig, RunConfig  # noqa: E402
from tpulab.train.sharding import layout_table, make_mesh  # noqa: E402
from tpulab.train.step import make_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
MESHES = (("data parallel", 4, 1), ("hybrid", 2, 2), ("FSDP", 1, 4))


def measure(
    config: RunConfig, name: str, data: int, fsdp: int, batches: list, n_steps: int, warmup: int
) -> dict:
    import dataclasses

    cfg = dataclasses.replace(config, mesh=MeshConfig(data=data, fsdp=fsdp))
    mesh = make_mesh(cfg.mesh)
    steps = make_steps(cfg, mesh)
    abstract = steps.abstract_state()
    batch0 = steps.put_batch(batches[0])
    compiled = steps.train.lower(abstract, batch0).compile()
    mem = compiled.memory_analysis()
    table = layout_table(abstract, mesh)
    state_bytes = sum(int(np.prod(r["per_device"])) * 4 for r in table)
    param_bytes = sum(
        int(np.prod(r["shape"])) * 4 for r in table if r["path"].startswith("params/")
    )
    replicated_fallback = [
        r["path"] for r in table if "replicated)" in r["rule"] and r["path"].startswith("params")
    ]
    state = steps.init()
    it = itertools.cycle(batches)

    def one():
        nonlocal state
        state, m = steps.train(state, steps.put_batch(next(it)))
        return m["loss"]

    times = time_steps(one, jax.block_until_ready, n_steps, warmup=warmup)
    return {
        "layout": name,
        "mesh": {"data": data, "fsdp": fsdp},
        "collectives": collectives(compiled.as_text()),
        "memory_analysis": {
            k: int(getattr(mem, k))
            for k in (
                "argument_size_in_bytes",
                "output_size_in_bytes",
                "temp_size_in_bytes",
                "alias_size_in_bytes",
            )
        },
        "state_bytes_per_device": state_bytes,
        "param_bytes_unsharded": param_bytes,
        "params_replicated_by_divisibility": replicated_fallback,
        "step_time": summarize(times),
    }


def markdown(rows: list[dict], env: dict, shapes: dict) -> str:
    lines = [
        "# Data parallel vs FSDP on 4 host devices "
        f"({env.get('backend')}, {env.get('device_kind')})",
        "",
        f"Shapes: {shapes}. float32. jax {env.get('packages', {}).get('jax')}, "
        f"commit {env.get('git_commit')}, {env.get('cpu_count')} cores, "
        f"load {env.get('load_avg_1m_5m_15m')}.",
        "",
    ]
    cells = []
    for r in rows:
        coll = "; ".join(
            f"{k} x{v['count']} ({v['bytes'] / 2**20:.2f})"
            for k, v in sorted(r["collectives"].items())
        )
        ma, st = r["memory_analysis"], r["step_time"]
        cells.append(
            (
                r["layout"],
                f"data={r['mesh']['data']} fsdp={r['mesh']['fsdp']}",
                coll or "none",
                f"{r['state_bytes_per_device'] / 2**20:.2f}",
                f"{ma['argument_size_in_bytes'] / 2**20:.2f}",
                f"{ma['temp_size_in_bytes'] / 2**20:.2f}",
                f"{st['median_s'] * 1e3:.1f} ms ({st['p10_s'] * 1e3:.1f}-{st['p90_s'] * 1e3:.1f})",
            )
        )
    headers = ["layout", "mesh", "collectives per step (count, result MiB per device)"]
    headers += ["state MiB / device", "argument MiB / device", "temp MiB / device"]
    lines.append(table([*headers, "step time median (p10-p90)"], cells))
    lines += [
        "",
        f"Parameters unsharded: {rows[0]['param_bytes_unsharded'] / 2**20:.2f} MiB (the gradient "
        "a data-parallel all-reduce must carry; a parser check: the data-parallel all-reduce "
        "bytes should be at least this).",
    ]
    notes = {p for r in rows for p in r["params_replicated_by_divisibility"]}
    if notes:
        lines += [
            "",
            "Replicated because fsdp does not divide the split dimension: "
            f"{', '.join(sorted(notes))}.",
        ]
    return "\n".join(lines) + "\n"


def render(result: dict) -> str:
    """OUT.md from OUT.json."""
    return markdown(result["rows"], result["environment"], result["shapes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaleout_comm")
    args = ap.parse_args()
    config = load(RunConfig, CONFIG, ["model.dropout=0"])
    if jax.device_count() != 4:
        raise SystemExit(f"needs 4 devices, JAX sees {jax.device_count()}")
    splits = build_splits(load_corpus(config.data.path), config.data)
    batches = list(itertools.islice(iter(train_dataset(splits.train_windows, config.data)), 8))
    rows = [measure(config, name, d, f, batches, args.steps, args.warmup) for name, d, f in MESHES]
    env = benchmark_environment()
    shapes = {
        "batch": config.data.batch_size,
        "seq_len": config.data.seq_len,
        "d_model": config.model.d_model,
        "n_layers": config.model.n_layers,
        "vocab": config.model.vocab_size,
    }
    md = markdown(rows, env, shapes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        args.out.with_suffix(".json"),
        {"rows": rows, "environment": env, "shapes": shapes, "config": to_dict(config)},
    )
    atomic_write_bytes(args.out.with_suffix(".md"), md.encode())
    print(md)


if __name__ == "__main__":
    main()
