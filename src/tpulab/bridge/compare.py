"""`tpulab bridge compare`: one seed and shape, every backend and method this machine runs, one
table. Every row, torch's included, is judged against the float64 NumPy reference
(``bridge.reference``); the torchax rows are also compared with torch."""

from __future__ import annotations

import os
from pathlib import Path

from tpulab.bridge.backends import runnable
from tpulab.bridge.config import BridgeConfig
from tpulab.bridge.reference import float64_curve, rel_diffs
from tpulab.checkpoint.files import atomic_write_json
from tpulab.config import to_dict
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import curve, read_records
from tpulab.evidence.report_kit import figure, table
from tpulab.proofs.driver import fresh_run_dir, run_to_completion

# Relative difference of the final loss from the float64 reference. Measured over the default 200
# steps: torch 9.2e-7, torchax eager 3.2e-7, torchax jit 4.3e-6 (its largest mid-run gap, 7.1e-5 at
# step 42, is reported beside it, not judged: Adam amplifies rounding there and it shrinks again);
# a reference with lr 0.1% off differs by 3.0e-4 at step 200 (tests/test_bridge_reference.py).
FLOAT64_RTOL = 1e-4


def compare(
    cfg: BridgeConfig,
    run_dir: str | Path,
    *,
    timeout_s: float = 600,
    env: dict | None = None,
    track: bool = True,
) -> dict:
    """Train each (backend, method) in run_dir/runs/B-M; write compare.json, compare.md and
    compare.png. ``track=False``: the children log no MLflow runs."""
    from tpulab.bridge.prove import train_argv
    from tpulab.bridge.report import device_line, start_record

    run_dir = Path(run_dir)
    if (run_dir / "compare.json").exists():
        raise TpulabError(f"{run_dir} already holds a comparison; use a fresh --run-dir")
    pairs = runnable()
    curves, devices = {}, {}
    for backend, method in pairs:
        d = fresh_run_dir(run_dir / "runs" / f"{backend}-{method}")
        run_to_completion(
            train_argv(cfg, backend, method, d, track=track),
            run_dir / f"{backend}-{method}.log",
            {**os.environ, **(env or {})},
            timeout_s,
            f"{backend}/{method} run",
        )
        curves[(backend, method)] = curve(read_records(d))
        devices[(backend, method)] = device_line(start_record(d).get("device", {}))
    ref = curves[("torch", "eager")]
    ref64 = float64_curve(cfg)
    rows = []
    for (backend, method), c in curves.items():
        steps = sorted(set(ref) & set(c))
        final = c[cfg.steps]
        is_ref = (backend, method) == ("torch", "eager")  # not compared with itself
        vs64 = rel_diffs(c, ref64) if ref64 is not None else None
        rows.append(
            {
                "backend": backend,
                "method": method,
                "final_loss": final,
                "max_rel_diff_vs_float64": vs64["max"] if vs64 else None,
                "rel_diff_final_vs_float64": vs64["final"] if vs64 else None,
                "within_tolerance": vs64["final"] < FLOAT64_RTOL if vs64 else None,
                "max_abs_diff_vs_torch": None if is_ref else max(abs(c[s] - ref[s]) for s in steps),
                "rel_diff_final": None
                if is_ref
                else abs(final - ref[cfg.steps]) / abs(ref[cfg.steps]),
                "device": devices[(backend, method)],
            }
        )
    md = markdown_table(rows, cfg)
    result = {
        "rows": rows,
        "config": to_dict(cfg),
        "steps": cfg.steps,
        "dtype": "float32",
        "reference": "float64 NumPy (tpulab.bridge.reference)"
        if ref64 is not None
        else "none (dropout or augmentation has no NumPy twin)",
        "float64_rtol": FLOAT64_RTOL,
        "skipped": _skipped(pairs),
    }
    atomic_write_json(run_dir / "compare.json", result)
    (run_dir / "compare.md").write_text(md)
    plot(curves, run_dir / "compare.png", cfg, ref64)
    return {**result, "markdown": md}


def _skipped(pairs) -> list[dict]:
    from tpulab.bridge.backends import torch_xla_problem

    return (
        []
        if ("torch_xla", "eager") in pairs
        else [{"backend": "torch_xla", "method": "eager", "reason": torch_xla_problem()}]
    )


def _num(x, fmt: str = ".3g", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def markdown_table(rows: list[dict], cfg: BridgeConfig) -> str:
    lines = [
        f"Same seed ({cfg.seed}), shapes (n={cfg.n}, d={cfg.d}, hidden={cfg.hidden}), float32, "
        f"Adam lr {cfg.lr}, {cfg.steps} steps. Reference: the same training in float64 NumPy "
        f"(tpulab.bridge.reference); tolerance {FLOAT64_RTOL:g} on the final loss's relative "
        "difference.",
        "",
    ]
    headers = ["backend", "method", f"final loss (step {cfg.steps})"]
    headers += ["rel diff vs float64 at final step", "within tolerance"]
    headers += ["max rel diff vs float64 (any step)", "max abs diff vs torch"]
    headers += ["rel diff vs torch at final step", "device"]
    cells = []
    for r in rows:
        ok = r["within_tolerance"]
        cells.append(
            (
                r["backend"],
                r["method"],
                f"{r['final_loss']:.9g}",
                _num(r["rel_diff_final_vs_float64"], none="no reference"),
                "-" if ok is None else "yes" if ok else "NO",
                _num(r["max_rel_diff_vs_float64"], none="no reference"),
                _num(r["max_abs_diff_vs_torch"], none="(torch)"),
                _num(r["rel_diff_final"], none="(torch)"),
                r["device"],
            )
        )
    lines.append(table(headers, cells))
    return "\n".join(lines) + "\n"


def plot(curves: dict, path: Path, cfg: BridgeConfig, ref64: dict | None = None) -> None:
    # the differences panel: every run against the float64 reference (or, without one, torchax
    # against torch)
    ref = ref64 if ref64 is not None else curves[("torch", "eager")]
    with figure(
        path, nrows=2, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    ) as (_, (ax, ax_d)):
        styles = [
            ("0.55", 4.0, "-"),
            ("tab:blue", 1.4, "--"),
            ("tab:red", 1.2, ":"),
            ("tab:green", 1.2, "-."),
        ]
        for (key, c), (color, lw, ls) in zip(curves.items(), styles):
            s = sorted(c)
            ax.plot(s, [c[i] for i in s], color=color, lw=lw, ls=ls, label=f"{key[0]}/{key[1]}")
            if ref64 is not None or key != ("torch", "eager"):
                ax_d.plot(
                    s,
                    [abs(c[i] - ref[i]) for i in s],
                    color=color,
                    lw=1.0,
                    label=f"{key[0]}/{key[1]}",
                )
        ax.set_yscale("log")
        ax.set_ylabel("train loss (MSE)")
        ax.set_title(
            f"same seed and data on every bridge: n={cfg.n}, d={cfg.d}, hidden={cfg.hidden}, "
            "float32"
        )
        ax.legend(fontsize=8)
        ax_d.set_yscale("symlog", linthresh=1e-9)
        ax_d.set_ylim(bottom=0)  # absolute differences: no negative half of the symlog axis
        ax_d.set_ylabel("|loss - float64 loss|" if ref64 is not None else "|loss - torch loss|")
        ax_d.set_xlabel("step")
        ax_d.legend(fontsize=8)
