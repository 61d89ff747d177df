"""HBM budget per TPU target: analytic bytes next to the XLA:TPU compiler's own peak, and a
recommendation.

Analytic, per device, for the trainer as it shards today (``make_steps``: state replicated, batch
split over the devices):

- parameters, gradients and both Adam moments, each ``N x bytes(param_dtype)``;
- activations kept for the backward pass, per layer and token: the block's inputs and outputs at
  the compute dtype (norms, q/k/v, rotated q/k, attention output, residuals, MLP up and GELU:
  ``18 d`` values) plus fp32 attention scores and probabilities (``2 H T``), plus fp32 logits and
  log-probabilities at the end (``2 V``); with per-block rematerialization (the trainer's
  ``model.remat=block``) only each block's input is kept and one block's activations are live at
  a time;
- an XLA workspace margin (``WORKSPACE_MARGIN`` of the rest).

Serving: replicated weights plus the KV cache (``model.kvcache`` layout) for B sequences of T
tokens in fp32, bf16 or int8 (int8 with its fp32 scales). Each target also gets the real train
step and decode step compiled for its topology with libtpu (``tpulab.perf.aot``), and the step is
placed against the chip's ridge point (peak FLOP/s / HBM bandwidth) using the compiler's FLOPs and
bytes accessed. The fit verdict uses the compiler's peak where the compile succeeded (it is the
program that would run; the analytic activation count overstates what XLA keeps live) and the
analytic total elsewhere; "does not fit anywhere" is decided analytically, with rematerialization,
before anything is compiled.

Rematerialization is recommended only as the trainer has it: where a target does not hold the step
as configured (the compiler refused it, or it leaves less than the headroom), the same step is
compiled again with ``model.remat=block`` (``REMAT``) and the compiler's peak of that program
decides; the recommendation names the config value to set.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from tpulab.errors import TpulabError
from tpulab.evidence import report_kit
from tpulab.evidence.report_kit import figure
from tpulab.model.config import matmul_params, param_count
from tpulab.perf import aot
from tpulab.perf.chips import CHIPS

if TYPE_CHECKING:
    from pathlib import Path

    from tpulab.train.config import RunConfig

WORKSPACE_MARGIN = 0.10  # XLA scratch, fusion buffers, collectives: a margin, not a measurement
HEADROOM = 0.20  # a recommended slice keeps this share of HBM free (fragmentation, bigger eval)
DISAGREE = 0.20  # analytic vs compiler differences above this are explained in the table
REMAT = "block"  # the model.remat value the budget falls back to: it keeps the least
_BYTES = {"float32": 4, "bfloat16": 2}


class DoesNotFit(TpulabError):
    """The configuration fits none of the requested targets."""


def train_flops(config: RunConfig) -> float:
    """Analytic FLOPs of one train step (whole batch): 6 N tokens plus attention (12 L B T^2 d, no
    causal skip)."""
    m, b, t = config.model, config.data.batch_size, config.data.seq_len
    return 6.0 * matmul_params(m) * b * t + 12.0 * m.n_layers * b * t * t * m.d_model


def activation_bytes(config: RunConfig, batch: int, *, remat: bool) -> int:
    m, t = config.model, config.data.seq_len
    c = _BYTES[config.precision.compute_dtype]
    per_layer_token = (
        18 * m.d_model * c + 2 * m.n_heads * t * 4 + (m.n_heads * t if m.dropout > 0 else 0)
    )
    head_token = 2 * m.vocab_size * 4 + m.d_model * c
    if remat:
        per_token = m.n_layers * m.d_model * c + per_layer_token + head_token
    else:
        per_token = m.n_layers * per_layer_token + head_token
    return batch * t * per_token


def train_budget(config: RunConfig, devices: int) -> dict:
    n = param_count(config.model)
    p = _BYTES[config.precision.param_dtype]
    per_device_batch = max(1, config.data.batch_size // devices)
    state = {"params": n * p, "grads": n * p, "adam_mu": n * p, "adam_nu": n * p}
    # As configured: a run with model.remat=block keeps what the remat count keeps (dots_saveable
    # keeps more than that and is counted as no remat: an upper bound).
    configured = config.model.remat == "block"
    act, act_remat = (
        activation_bytes(config, per_device_batch, remat=r) for r in (configured, True)
    )
    base = sum(state.values())
    return {
        **state,
        "activations": act,
        "activations_remat": act_remat,
        "workspace": int(WORKSPACE_MARGIN * (base + act)),
        "total": int((base + act) * (1 + WORKSPACE_MARGIN)),
        "total_remat": int((base + act_remat) * (1 + WORKSPACE_MARGIN)),
        "param_count": n,
        "per_device_batch": per_device_batch,
    }


def kv_cache_bytes(config: RunConfig, batch: int, context: int, policy: str) -> int:
    """Bytes of the inference cache for ``batch`` sequences of ``context`` slots (its own layout and
    scales)."""
    from tpulab.model import kvcache as kv

    m = config.model
    return kv.CacheShape(m.n_layers, context, m.n_heads, m.head_dim).nbytes(policy, batch)


def _explain(kind: str, analytic: float, compiled: float) -> str:
    if not analytic or not compiled or abs(compiled - analytic) <= DISAGREE * analytic:
        return ""
    more = compiled > analytic
    if kind == "memory":
        return (
            "compiler peak above analytic: XLA holds fp32 temporaries/fusion outputs and the "
            "updated state alongside the old one beyond the margin"
            if more
            else "compiler peak below analytic: XLA frees or recomputes cheap activations "
            "(elementwise fusions) and never holds all gradients and activations at once"
        )
    return (
        "compiler counts elementwise work (softmax, GELU, norms, AdamW) that 6N·tokens leaves out"
        if more
        else "compiler counts fewer FLOPs than the analytic matmul count (fused or simplified ops)"
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def budget(
    config: RunConfig,
    targets: str,
    *,
    serve_batch: int = 8,
    serve_context: int | None = None,
    compile_steps: bool = True,
) -> dict:
    """Per target: analytic vs compiled memory and FLOPs, fit verdicts, roofline placement; plus a
    recommendation."""
    parsed = aot.parse_targets(targets)
    context = serve_context or config.model.max_seq_len
    if serve_batch <= 0 or context <= 0:
        raise TpulabError(
            f"--serve-batch ({serve_batch}) and --serve-context ({context}) must be positive"
        )
    rows = []
    if compile_steps:  # a model that cannot fit anywhere is refused before any compile
        check_fits(
            budget(
                config,
                targets,
                serve_batch=serve_batch,
                serve_context=serve_context,
                compile_steps=False,
            )
        )
    for target in parsed:
        devices = len(aot.topology_devices(target.name))
        per_chip = devices / target.chips  # libtpu shows a v4 chip as 2 devices, a v5p chip as 1
        hbm = target.chip.hbm_bytes / per_chip
        peak = target.chip.peak_bf16_flops / per_chip
        bw = target.chip.hbm_bytes_per_s / per_chip
        train = train_budget(config, devices)
        serve_weights = param_count(config.model) * _BYTES[config.precision.param_dtype]
        serve = {
            pol: serve_weights
            + kv_cache_bytes(config, math.ceil(serve_batch / devices), context, pol)
            for pol in ("fp32", "bf16", "int8")
        }
        analytic_flops = train_flops(config) / devices
        row = {
            "target": target.name,
            "generation": target.chip.generation,
            "chips": target.chips,
            "devices": devices,
            "hbm_per_device": int(hbm),
            "train": train,
            "serve": {"batch": serve_batch, "context": context, "bytes_per_device": serve},
            "analytic_flops_per_device": analytic_flops,
            "ridge_bf16": target.chip.ridge("bf16"),
            "ridge_int8": target.chip.ridge("int8"),
            "chip_source": target.chip.source,
        }
        if compile_steps:
            try:
                c = aot.compile_train_step(config, target.name)
            except aot.CompilerOutOfMemory as e:
                c = None
                row["compiler_refused"] = str(e)
            short = c is None or c["peak_bytes"] > (1 - HEADROOM) * hbm
            if short and config.model.remat == "none":
                row["compiled_train_remat"] = _compile_remat(config, target.name)
            serve_cfg = dataclasses.replace(
                config,
                model=dataclasses.replace(config.model, max_seq_len=context),
                data=dataclasses.replace(config.data, seq_len=min(config.data.seq_len, context)),
            )
            try:
                row["compiled_decode_bf16"] = aot.compile_decode_step(
                    serve_cfg, target.name, _round_up(serve_batch, devices), "bf16"
                )
            except aot.CompilerOutOfMemory as e:
                row["compiled_decode_bf16"] = {"refused": str(e)}
        else:
            c = None
        if c is not None:
            intensity = c["flops"] / c["bytes_accessed"] if c["bytes_accessed"] else None
            row["compiled_train"] = c
            row["arithmetic_intensity"] = intensity
            row["bound"] = (
                None
                if intensity is None
                else ("compute-bound" if intensity >= row["ridge_bf16"] else "memory-bound")
            )
            row["compute_time_floor_s"] = c["flops"] / peak
            row["memory_time_floor_s"] = c["bytes_accessed"] / bw
            row["memory_note"] = _explain("memory", train["total"], c["peak_bytes"])
            row["flops_note"] = _explain("flops", analytic_flops, c["flops"])
            row["compiled_vs_analytic_memory"] = _ratio(c["peak_bytes"], train["total"])
            row["compiled_vs_analytic_flops"] = _ratio(c["flops"], analytic_flops)
        need = _need(row)
        row["need_bytes"] = need
        row["train_fits"] = need <= hbm and "compiler_refused" not in row
        row["train_fits_with_headroom"] = row["train_fits"] and need <= (1 - HEADROOM) * hbm
        remat = row.get("compiled_train_remat")
        if remat is not None:  # the compiler's verdict on the model.remat=block program
            row["need_bytes_remat"] = remat.get("peak_bytes")
            fits_remat = "refused" not in remat and remat["peak_bytes"] <= hbm
        else:  # not compiled (or it fit as configured): the analytic count
            row["need_bytes_remat"] = train["total_remat"]
            fits_remat = train["total_remat"] <= hbm
        row["train_fits_remat"] = row["train_fits"] or fits_remat
        row["train_fits_remat_with_headroom"] = row["train_fits_with_headroom"] or (
            fits_remat and row["need_bytes_remat"] <= (1 - HEADROOM) * hbm
        )
        row["serve_fits"] = {pol: b <= hbm for pol, b in serve.items()}
        rows.append(row)
    return {
        "rows": rows,
        "recommendation": recommend(rows),
        "margin": WORKSPACE_MARGIN,
        "headroom": HEADROOM,
        "libtpu": aot.libtpu_version(),
    }


def _compile_remat(config: RunConfig, target_name: str) -> dict:
    """The train step compiled again with ``model.remat=REMAT``: its compiler numbers, or the
    compiler's refusal."""
    cfg = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=REMAT))
    try:
        return {**aot.compile_train_step(cfg, target_name), "remat": REMAT}
    except aot.CompilerOutOfMemory as e:
        return {"refused": str(e), "remat": REMAT}


def _need(row: dict) -> int:
    """Bytes per device the train step needs: the compiler's peak when it compiled (it is the
    program that will run, temporaries included), else the analytic total (margin included)."""
    compiled = row.get("compiled_train")
    return compiled["peak_bytes"] if compiled else row["train"]["total"]


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def recommend(rows: list[dict]) -> dict:
    """The smallest slice (fewest chips, then least HBM) that trains with headroom as configured;
    else with ``model.remat=REMAT`` (the trainer's own option, named); else the smallest that holds
    the step at all, said to be without the headroom; else none."""
    order = sorted(rows, key=lambda r: (r["chips"], r["hbm_per_device"] * r["devices"]))
    remat = f"with model.remat={REMAT}"
    passes = (
        ("train_fits_with_headroom", "as configured", False),
        ("train_fits_remat_with_headroom", remat, True),
        ("train_fits", "as configured, without the headroom", False),
        ("train_fits_remat", f"{remat}, without the headroom", True),
    )
    for key, how, with_remat in passes:
        for r in order:
            if not r[key]:
                continue
            if not with_remat:
                need = r["need_bytes"]
                compiled = "compiled_train" in r
                basis = "the XLA:TPU compiler's peak" if compiled else "the analytic estimate"
            else:
                need = r["need_bytes_remat"]
                compiled = "peak_bytes" in r.get("compiled_train_remat", {})
                basis = (
                    f"the XLA:TPU compiler's peak of the model.remat={REMAT} step"
                    if compiled
                    else "the analytic estimate with rematerialization"
                )
            return {
                "target": r["target"],
                "how": how,
                "set": f"model.remat={REMAT}" if with_remat else None,
                "why": f"fewest chips among the targets that hold the train step {how}: needs "
                f"{_gib(need)} of {_gib(r['hbm_per_device'])} HBM per device "
                f"({100 * need / r['hbm_per_device']:.1f}% by {basis}; at most "
                f"{100 * (1 - HEADROOM):.0f}% leaves the headroom)",
            }
    return {"target": None, "how": None, "set": None, "why": "fits none of the targets"}


def check_fits(result: dict) -> None:
    """Raise DoesNotFit when no target can hold the train step (even with model.remat=REMAT)."""
    if result["recommendation"]["target"] is None:
        need = lambda r: r["need_bytes_remat"] or r["train"]["total_remat"]  # noqa: E731
        best = min(result["rows"], key=lambda r: need(r) / r["hbm_per_device"])
        raise DoesNotFit(
            f"this model fits none of {', '.join(r['target'] for r in result['rows'])}: the train "
            f"step needs {_gib(need(best))} per device even with "
            f"model.remat={REMAT}, {best['target']} has {_gib(best['hbm_per_device'])}; pick a "
            "bigger slice or a smaller model (nothing was provisioned)"
        )


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def _fits(r: dict) -> str:
    if r["train_fits_with_headroom"]:
        return "yes"
    if r["train_fits"]:
        return "tight"
    if r["train_fits_remat_with_headroom"]:
        return f"with model.remat={REMAT}"
    return f"tight with model.remat={REMAT}" if r["train_fits_remat"] else "NO"


def _compiled_cell(r: dict) -> str:
    c, refused = r.get("compiled_train"), r.get("compiler_refused")
    cell = _gib(c["peak_bytes"]) if c else ("REFUSED (out of HBM)" if refused else "-")
    remat = r.get("compiled_train_remat")
    if remat:
        got = "REFUSED" if "refused" in remat else _gib(remat["peak_bytes"])
        cell += f"; model.remat={remat['remat']}: {got}"
    return cell


def table(result: dict) -> str:
    """Markdown: one row per target (per device), then the recommendation."""
    headers = ["target", "dev", "HBM/dev", "params+grads+Adam", "activations (remat)"]
    headers += ["analytic total (remat)", "compiled peak", "fits", "serve bf16 / int8 KV"]
    headers += ["compiler GFLOP vs analytic", "AI (FLOP/B) vs ridge bf16", "notes"]
    cells = []
    for r in result["rows"]:
        t = r["train"]
        state = t["params"] + t["grads"] + t["adam_mu"] + t["adam_nu"]
        c = r.get("compiled_train")
        ai = (
            f"{r['arithmetic_intensity']:.1f} vs {r['ridge_bf16']:.0f} ({r['bound']})" if c else "-"
        )
        flops = (
            f"{c['flops'] / 1e9:.2f} vs {r['analytic_flops_per_device'] / 1e9:.2f}"
            if c
            else f"- vs {r['analytic_flops_per_device'] / 1e9:.2f}"
        )
        refusals = [r.get("compiler_refused"), r.get("compiled_train_remat", {}).get("refused")]
        notes = "; ".join(
            n
            for n in (
                r.get("memory_note"),
                r.get("flops_note"),
                *(m and "XLA:TPU refused to compile: " + m.split(": ", 1)[-1] for m in refusals),
            )
            if n
        )
        s = r["serve"]["bytes_per_device"]
        cells.append(
            (
                r["target"],
                r["devices"],
                _gib(r["hbm_per_device"]),
                _gib(state),
                f"{_gib(t['activations'])} ({_gib(t['activations_remat'])})",
                f"{_gib(t['total'])} ({_gib(t['total_remat'])})",
                _compiled_cell(r),
                _fits(r),
                f"{_gib(s['bf16'])} / {_gib(s['int8'])}",
                flops,
                ai,
                notes,
            )
        )
    rec = result["recommendation"]
    lines = [report_kit.table(headers, cells), ""]
    lines.append(
        f"Recommendation: {rec['target']}"
        + (f" with `{rec['set']}`" if rec.get("set") else "")
        + f" ({rec['why']})"
        if rec["target"]
        else f"Recommendation: none — {rec['why']}"
    )
    lines.append("")
    lines.append(
        "Chip figures: " + "; ".join(f"{c.generation}: {c.source}" for c in CHIPS.values())
    )
    return "\n".join(lines)


def plot(result: dict, path) -> dict:
    """Train-step bytes per device against each target's HBM: analytic (with and without remat) and
    the XLA:TPU compiler's peaks. A program the compiler refused has no peak, so it is drawn as a
    hatched red bar above the HBM line, labelled, instead of as a missing (zero) bar. Returns what
    was drawn as refused."""
    import numpy as np

    rows, gib = result["rows"], 2**30
    x = np.arange(len(rows))
    hbm = np.array([r["hbm_per_device"] / gib for r in rows])
    with figure(path, figsize=(max(7, 1.6 * len(rows)) + 2.5, 3.8)) as (_, ax):
        width = 0.2
        ax.bar(x - 1.5 * width, [r["train"]["total"] / gib for r in rows], width, label="analytic")
        ax.bar(
            x - 0.5 * width,
            [r["train"]["total_remat"] / gib for r in rows],
            width,
            label="analytic, remat",
        )
        refused: dict[str, list[str]] = {"as configured": [], f"model.remat={REMAT}": []}
        for offset, key, label, color in (
            (0.5, "compiled_train", "XLA:TPU peak", "tab:green"),
            (1.5, "compiled_train_remat", f"XLA:TPU peak, model.remat={REMAT}", "tab:purple"),
        ):
            peaks = [r.get(key, {}).get("peak_bytes", 0) / gib for r in rows]
            ax.bar(x + offset * width, peaks, width, label=label, color=color)
            for i, r in enumerate(rows):
                gone = r.get("compiler_refused") if key == "compiled_train" else None
                gone = gone or r.get(key, {}).get("refused")
                if not gone:
                    continue
                first = not any(refused.values())
                refused[
                    "as configured" if key == "compiled_train" else f"model.remat={REMAT}"
                ].append(r["target"])
                ax.bar(
                    x[i] + offset * width,
                    1.25 * hbm[i],
                    width,
                    color="none",
                    edgecolor="tab:red",
                    hatch="xx",
                    label="refused by XLA:TPU (out of HBM)" if first else None,
                )
                ax.annotate(
                    "refused",
                    (x[i] + offset * width, 1.25 * hbm[i]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="tab:red",
                    rotation=90,
                )
        ax.scatter(x, hbm, marker="_", s=900, color="k", label="HBM/device", zorder=3)
        ax.set_xticks(x, [r["target"] for r in rows])
        ax.set_ylabel("GiB per device")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title("train step memory per device")
    return {"refused": refused}


def write_budget(
    config: RunConfig,
    targets: str,
    out_dir: str | Path,
    *,
    serve_batch: int = 8,
    serve_context: int | None = None,
) -> dict:
    """Run ``budget`` and write budget.json (with provenance and the config), budget.md and
    budget.png under ``out_dir``: new, empty, or holding only an earlier budget's three files
    (``runs/budget`` is the default: a rerun rewrites its own report), checked first."""
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, check_out, holds_only
    from tpulab.config import to_dict
    from tpulab.evidence.provenance import environment

    out = check_out(out_dir, reuse=holds_only("budget.json", "budget.md", "budget.png"))
    result = budget(config, targets, serve_batch=serve_batch, serve_context=serve_context)
    check_fits(result)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        **result,
        "config": to_dict(config),
        "param_count": param_count(config.model),
        "environment": {**environment(), "libtpu": aot.libtpu_version()},
        "method": "analytic bytes per device (see tpulab.perf.budget) next to XLA:TPU compiles "
        "of the train and decode steps for each topology via libtpu on this host (not executed)",
    }
    result["plot"] = plot(result, out / "budget.png")
    atomic_write_json(out / "budget.json", result)
    atomic_write_bytes(out / "budget.md", (table(result) + "\n\n![budget](budget.png)\n").encode())
    return result
