"""model.remat at the default config: the same numbers, less memory, more FLOPs.

For each ``model.remat`` value (none, block, dots_saveable) the trainer's own train step
(``make_steps``) is

- run for two steps on this host from the same init and batch: every leaf of the final TrainState
  (parameters, both Adam moments, step, dropout key) and the metrics are compared with ``none``,
  bitwise and as max |difference|;
- compiled for XLA:CPU here (``memory_analysis().temp_size_in_bytes``, ``cost_analysis()`` FLOPs);
- compiled for a TPU target with libtpu (``tpulab.perf.aot.compile_train_step``: the compiler's
  peak bytes per device and FLOPs; not run).

    .venv/bin/python benchmarks/remat_memory.py [--target v5e:2x2] [--set KEY=VALUE ...]

Writes benchmarks/results/remat_memory.{json,md}.
"""

from __future__ import annotations

from tpulab.process_setup import prepare

prepare()  # as the CLI does, before JAX starts its threads or a backend

import argparse  # noqa: E402
import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json  # noqa: E402
from tpulab.config import load, to_dict  # noqa: E402
from tpulab.evidence.report_kit import table  # noqa: E402
from tpulab.perf import aot  # noqa: E402
from tpulab.perf.bench import synthetic_batch  # noqa: E402
from tpulab.perf.timing import benchmark_environment  # noqa: E402
from tpulab.train.config import RunConfig  # noqa: E402
from tpulab.train.step import make_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
REMATS = ("none", "block", "dots_saveable")


def measure(config: RunConfig, target: str) -> dict:
    s = make_steps(config)
    batch = s.put_batch(synthetic_batch(config))
    compiled = s.train.lower(s.abstract_state(), batch).compile()
    state, metrics = s.init(), []
    for _ in range(2):
        state, m = s.train(state, batch)
        metrics.append({k: np.asarray(v) for k, v in m.items()})
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    tpu = aot.compile_train_step(config, target)
    return {
        "state": {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves},
        "metrics": metrics,
        "cpu": {
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "flops": float((compiled.cost_analysis() or {}).get("flops", 0.0)),
        },
        "tpu": {k: tpu[k] for k in ("peak_bytes", "temp_bytes", "flops", "device_kind", "devices")},
    }


def compare(a: dict, b: dict) -> dict:
    """Bitwise equality and max |difference| of two runs' final states and metrics."""
    diffs = [
        float(np.max(np.abs(a["state"][k].astype(np.float64) - b["state"][k].astype(np.float64))))
        for k in a["state"]
        if a["state"][k].dtype.kind == "f"
    ]
    return {
        "state_bitwise_equal": all(
            np.array_equal(a["state"][k], b["state"][k]) for k in a["state"]
        ),
        "metrics_bitwise_equal": all(
            np.array_equal(x[k], y[k]) for x, y in zip(a["metrics"], b["metrics"]) for k in x
        ),
        "max_abs_state_diff": max(diffs),
        "leaves": len(a["state"]),
    }


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [
        f"# model.remat at {r['shapes']} ({env['backend']} here; {r['target']} compiled with "
        f"libtpu {env.get('libtpu')}, not run)",
        "",
        f"jax {env['packages'].get('jax')}, commit {env['git_commit']}, {env['cpu_count']} cores, "
        f"load {env['load_avg_1m_5m_15m']} (a shared host: other jobs ran alongside).",
        "",
    ]
    base = r["rows"][0]

    def vs_base(row: dict, key: str) -> str:
        return f"({100 * row['tpu'][key] / base['tpu'][key] - 100:+.0f}%)"

    rows = []
    for row in r["rows"]:
        c = row["vs_none"]
        rows.append(
            (
                row["remat"],
                # a "|" here is escaped by table(): before it, it split this cell in two
                "bitwise / bitwise"
                if c["state_bitwise_equal"] and c["metrics_bitwise_equal"]
                else f"max |diff| {c['max_abs_state_diff']:.3g}",
                f"{row['cpu']['temp_bytes'] / 2**20:.2f}",
                f"{row['cpu']['flops'] / 1e9:.2f}",
                f"{row['tpu']['peak_bytes'] / 2**20:.2f} {vs_base(row, 'peak_bytes')}",
                f"{row['tpu']['flops'] / 1e9:.2f} {vs_base(row, 'flops')}",
            )
        )
    headers = ["model.remat", "2 steps vs none: state / metrics", "XLA:CPU temp MiB"]
    headers += ["XLA:CPU GFLOP", f"XLA:TPU peak MiB per device ({r['target']})"]
    lines.append(table([*headers, "XLA:TPU GFLOP per device"], rows))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="v5e:2x2")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "remat_memory")
    args = ap.parse_args()
    base = load(RunConfig, CONFIG, args.overrides)
    runs = {}
    for remat in REMATS:
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat=remat))
        runs[remat] = measure(cfg, args.target)
    rows = [
        {
            "remat": remat,
            "vs_none": compare(runs["none"], run),
            "cpu": run["cpu"],
            "tpu": run["tpu"],
        }
        for remat, run in runs.items()
    ]
    m = base.model
    result = {
        "rows": rows,
        "target": args.target,
        "shapes": f"d_model {m.d_model}, {m.n_layers} layers, dropout {m.dropout}, batch "
        f"{base.data.batch_size} x {base.data.seq_len}, {base.precision.compute_dtype}",
        "config": to_dict(base),
        "environment": {**benchmark_environment(), "libtpu": aot.libtpu_version()},
        "method": "two train steps from the same init and synthetic batch per remat value; "
        "XLA:CPU compile here; XLA:TPU AOT compile via libtpu (not run)",
    }
    md = markdown(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), result)
    atomic_write_bytes(args.out.with_suffix(".md"), md.encode())
    print(md)


if __name__ == "__main__":
    main()
