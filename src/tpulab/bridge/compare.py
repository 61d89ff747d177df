"""`tpulab bridge compare`: one seed and shape, every backend and method this machine runs, one table."""

from __future__ import annotations

import os
from pathlib import Path

from tpulab.bridge.backends import runnable
from tpulab.bridge.config import BridgeConfig
from tpulab.checkpoint.files import atomic_write_json
from tpulab.config import to_dict
from tpulab.errors import TpulabError
from tpulab.evidence import metrics as M
from tpulab.proofs.driver import run_to_completion


def compare(
    cfg: BridgeConfig, run_dir: str | Path, *, timeout_s: float = 600, env: dict | None = None
) -> dict:
    """Train each (backend, method) in run_dir/runs/B-M; write compare.json, compare.md and compare.png."""
    from tpulab.bridge.prove import train_argv
    from tpulab.bridge.report import device_line, start_record

    run_dir = Path(run_dir)
    if (run_dir / "compare.json").exists():
        raise TpulabError(f"{run_dir} already holds a comparison; use a fresh --run-dir")
    pairs = runnable()
    curves, devices = {}, {}
    for backend, method in pairs:
        d = run_dir / "runs" / f"{backend}-{method}"
        if (d / M.METRICS).exists():
            raise TpulabError(f"{d} already holds a run; use a fresh --run-dir")
        d.mkdir(parents=True)
        run_to_completion(
            train_argv(cfg, backend, method, d),
            run_dir / f"{backend}-{method}.log",
            {**os.environ, **(env or {})},
            timeout_s,
            f"{backend}/{method} run",
        )
        curves[(backend, method)] = M.curve(M.read_records(d))
        devices[(backend, method)] = device_line(start_record(d).get("device", {}))
    ref = curves[("torch", "eager")]
    rows = []
    for (backend, method), c in curves.items():
        steps = sorted(set(ref) & set(c))
        final = c[cfg.steps]
        rows.append(
            {
                "backend": backend,
                "method": method,
                "final_loss": final,
                "max_abs_diff_vs_torch": max(abs(c[s] - ref[s]) for s in steps),
                "rel_diff_final": abs(final - ref[cfg.steps]) / abs(ref[cfg.steps]),
                "device": devices[(backend, method)],
            }
        )
    md = markdown_table(rows, cfg)
    result = {
        "rows": rows,
        "config": to_dict(cfg),
        "steps": cfg.steps,
        "dtype": "float32",
        "skipped": _skipped(pairs),
    }
    atomic_write_json(run_dir / "compare.json", result)
    (run_dir / "compare.md").write_text(md)
    plot(curves, run_dir / "compare.png", cfg)
    return {**result, "markdown": md}


def _skipped(pairs) -> list[dict]:
    from tpulab.bridge.backends import torch_xla_problem

    return (
        []
        if ("torch_xla", "eager") in pairs
        else [{"backend": "torch_xla", "method": "eager", "reason": torch_xla_problem()}]
    )


def markdown_table(rows: list[dict], cfg: BridgeConfig) -> str:
    lines = [
        f"Same seed ({cfg.seed}), shapes (n={cfg.n}, d={cfg.d}, hidden={cfg.hidden}), float32, "
        f"Adam lr {cfg.lr}, {cfg.steps} steps.",
        "",
        f"| backend | method | final loss (step {cfg.steps}) | max abs diff vs torch | rel diff at final step | device |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['method']} | {r['final_loss']:.9g} | {r['max_abs_diff_vs_torch']:.3g} "
            f"| {r['rel_diff_final']:.3g} | {r['device']} |"
        )
    return "\n".join(lines) + "\n"


def plot(curves: dict, path: Path, cfg: BridgeConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = curves[("torch", "eager")]
    fig, (ax, ax_d) = plt.subplots(
        2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    styles = [
        ("0.55", 4.0, "-"),
        ("tab:blue", 1.4, "--"),
        ("tab:red", 1.2, ":"),
        ("tab:green", 1.2, "-."),
    ]
    for (key, c), (color, lw, ls) in zip(curves.items(), styles):
        s = sorted(c)
        ax.plot(s, [c[i] for i in s], color=color, lw=lw, ls=ls, label=f"{key[0]}/{key[1]}")
        if key != ("torch", "eager"):
            ax_d.plot(
                s, [abs(c[i] - ref[i]) for i in s], color=color, lw=1.0, label=f"{key[0]}/{key[1]}"
            )
    ax.set_yscale("log")
    ax.set_ylabel("train loss (MSE)")
    ax.set_title(
        f"same seed and data on every bridge: n={cfg.n}, d={cfg.d}, hidden={cfg.hidden}, float32"
    )
    ax.legend(fontsize=8)
    ax_d.set_yscale("symlog", linthresh=1e-9)
    ax_d.set_ylim(bottom=0)  # absolute differences: no negative half of the symlog axis
    ax_d.set_ylabel("|loss - torch loss|")
    ax_d.set_xlabel("step")
    ax_d.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
