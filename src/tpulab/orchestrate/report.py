"""The evidence report: Markdown sections (provenance, the run, curves, goodput, the proof, chaos,
the checks) and one self-contained HTML page with the same content.

report.html is rendered from the very Markdown written to report.md (one source, so the two cannot
disagree), with every image embedded as a data URI and no script, font or style fetched from
anywhere: it opens offline, from a mail attachment or an artifact store. ``build_report(dir)``
assembles the report from the evidence already on disk (a run dir, a prove-resume dir or a
capstone dir).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tpulab.evidence.html import render_html
from tpulab.evidence.metrics import METRICS, curve, read_records, starts
from tpulab.evidence.provenance import describe_hardware
from tpulab.proofs.checks import table_markdown
from tpulab.proofs.driver import verdict_text


def steady_tokens_per_s(run_dir: Path, tokens_per_step: int, skip: int = 5) -> float | None:
    """Median over steps of tokens / wall-clock delta, first ``skip`` steps (compile, warm-up) left
    out."""
    recs = [r for r in read_records(run_dir) if "loss" in r and r.get("segment") == 0]
    deltas = [
        b["wall_s"] - a["wall_s"]
        for a, b in zip(recs, recs[1:])
        if a["step"] >= skip and b["step"] == a["step"] + 1
    ]
    deltas = [d for d in deltas if d > 0]
    return tokens_per_step / statistics.median(deltas) if deltas else None


def provenance_section(env: dict) -> str:
    pk = env.get("packages", {})
    versions = ", ".join(f"{k} {v}" for k, v in pk.items() if v)
    return "\n".join(
        [
            "## What this ran on",
            "",
            f"- Hardware: **{describe_hardware(env)}** "
            f"(as JAX reported it: backend `{env.get('backend')}`, "
            f"device kind `{env.get('device_kind')}`, {env.get('device_count')} device(s), "
            f"{env.get('process_count')} process(es))",
            f"- Python {env.get('python')} on {env.get('platform')}",
            f"- Versions: {versions}",
            f"- Commit: `{env.get('git_commit') or 'not a git checkout'}`",
            f"- Date (UTC): {env.get('time_utc')}",
        ]
    )


def run_section(run_dir: Path) -> str:
    env = json.loads((run_dir / "env.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    docs = json.loads((run_dir / "documents.json").read_text())
    prec, shapes = env["precision"], env["shapes"]
    tps = steady_tokens_per_s(run_dir, shapes["batch"] * shapes["seq_len"])
    manifest = run_dir / "checkpoints" / str(summary["latest_checkpoint"]) / "tpulab_manifest.json"
    from tpulab.checkpoint.files import sha256_file

    return "\n".join(
        [
            "## The training run",
            "",
            "| what | value |",
            "|---|---|",
            f"| precision policy | params {prec['param_dtype']}, compute {prec['compute_dtype']}, "
            f"accumulation {prec['accum_dtype']} |",
            f"| shapes | batch {shapes['batch']} × sequence {shapes['seq_len']}; "
            f"d_model {shapes['d_model']}, {shapes['n_layers']} layers, {shapes['n_heads']} heads, "
            f"vocab {shapes['vocab']} (bytes + BOS + PAD) |",
            f"| parameters | {env['param_count']:,} |",
            f"| steps | {summary['final_step']} |",
            f"| final train loss | {summary['final_loss']:.4f} |",
            f"| final validation loss | {summary['final_val_loss']:.4f} "
            "(held-out whole documents) |",
            f"| steady-state throughput | {tps:,.0f} tokens/s "
            "(median over steps, compile and warm-up excluded) |"
            if tps
            else "| steady-state throughput | n/a |",
            f"| time to first step (incl. compile) | {summary['time_to_first_step_s']:.1f} s |",
            f"| corpus | {docs['source']}: {len(docs['train_documents'])} train / "
            f"{len(docs['validation_documents'])} validation documents, "
            f"identity `{docs['identity'][:16]}…` |",
            f"| final checkpoint | step {summary['latest_checkpoint']}, "
            f"manifest sha256 `{sha256_file(manifest)[:16]}…` |"
            if manifest.exists()
            else "| final checkpoint | missing |",
        ]
    )


def proof_section(proof_dir: Path, rel: str) -> str:
    v = json.loads((proof_dir / "verdict.json").read_text())
    verdict = (
        "**bitwise identical**"
        if v["identical"]
        else f"**NOT identical** (first differing step {v['first_differing_step']})"
    )
    return "\n".join(
        [
            "## Kill/resume proof",
            "",
            f"A second run with the same config was killed with **{v['signal']}** right after "
            f"step {v['kill_step']} (a real process; no handler ran). A fresh process resumed from "
            f"the newest valid checkpoint, step {v['resumed_from_step']}, redid "
            f"{v['steps_redone']} steps and trained to step {v['steps']}.",
            "",
            f"Verdict: {verdict} against the uninterrupted run: {verdict_text(v)}; "
            f"max |diff| = {v['max_abs_diff']:g}. Checkpoint dir at the kill: "
            f"{', '.join(v.get('checkpoints_at_kill', [])) or 'n/a'}.",
            "",
            f"![overlay]({rel}/overlay.png)",
            "",
            f"Evidence: `{rel}/verdict.json`, per-step losses in each run's `metrics.jsonl`.",
        ]
    )


def chaos_section(chaos_dir: Path, rel: str) -> str:
    v = json.loads((chaos_dir / "verdict.json").read_text())
    return "\n".join(
        [
            "## Chaos: SIGKILL at random moments",
            "",
            f"The run was SIGKILLed **{v['kills']}** times at random wall-clock moments "
            f"(seed {v['seed']}; no hold, no withheld marker), {v['kills_during_save']} of them "
            "while a checkpoint save was in flight, and resumed each time in a fresh process "
            f"({v['segments']} process lifetimes; resumed from steps "
            f"{', '.join(str(s) for s in v['resumed_from_steps'])}).",
            "",
            f"Verdict: **{'identical' if v['identical'] else 'NOT identical'}**: {v['summary']}.",
            "",
            f"![chaos]({rel}/segments.png)",
            "",
            f"Evidence: `{rel}/verdict.json`, the victim's `metrics.jsonl` "
            "(one segment per process lifetime).",
        ]
    )


def checks_section(results: list[dict]) -> str:
    return "## Independent checks\n\n" + table_markdown(results)


def curves_section(run_dir: Path, out_png: Path, rel: str) -> str:
    """Training loss (every process lifetime) and validation loss over steps, plotted to
    ``out_png``."""
    recs = read_records(run_dir)
    loss = curve(recs, "loss")
    val = {r["step"]: r["val_loss"] for r in recs if r.get("event") == "eval"}
    if not loss:
        return "## Training curves\n\nNo step was logged."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = sorted(loss)
    ax.plot(xs, [loss[s] for s in xs], lw=1.2, label="train loss (per step)")
    if val:
        vs = sorted(val)
        ax.plot(
            vs, [val[s] for s in vs], "o-", lw=1.2, label="validation loss (held-out documents)"
        )
    for st in starts(recs)[1:]:
        if st.get("resumed_from") is not None:
            ax.axvline(st["resumed_from"], color="k", ls=":", lw=0.8)
    ax.set_xlabel("step (dotted: a process resumed from this checkpoint)")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return f"## Training curves\n\n![training and validation loss]({rel})"


def goodput_section(run_dir: Path, title: str, kill_tail_s: float = 0.0) -> str:
    from tpulab.evidence.goodput import goodput, markdown

    return markdown(goodput(run_dir, kill_tail_s), title)


def find_run_dir(d: Path) -> Path | None:
    for cand in (d, d / "run", d / "proof" / "reference"):
        if (cand / "env.json").exists() and (cand / METRICS).exists():
            return cand
    return None


def build_report(d: str | Path) -> str:
    """The report Markdown for whatever evidence ``d`` holds (links relative to ``d``)."""
    from tpulab.errors import TpulabError

    d = Path(d)
    if not d.is_dir():
        raise TpulabError(f"{d} is not a directory")
    run_dir = find_run_dir(d)
    if (
        run_dir is None
        and not (d / "proof" / "verdict.json").exists()
        and not (d / "chaos" / "verdict.json").exists()
    ):
        raise TpulabError(f"{d} holds no run (env.json and metrics.jsonl), proof or chaos evidence")
    sections = []
    if run_dir is not None:
        rel = run_dir.relative_to(d).as_posix()
        sections.append(provenance_section(json.loads((run_dir / "env.json").read_text())))
        if (run_dir / "summary.json").exists():
            sections.append(run_section(run_dir))
        else:
            sections.append(
                "## The training run\n\nNo summary.json: this run has not ended normally yet."
            )
        sections.append(curves_section(run_dir, d / "plots" / "curves.png", "plots/curves.png"))
        sections.append(goodput_section(run_dir, f"Goodput of `{rel or '.'}`"))
    if (d / "proof" / "verdict.json").exists():
        sections.append(
            proof_section(d / "proof", "proof")
            + "\n\n"
            + goodput_section(d / "proof" / "interrupted", "Goodput of the killed-and-resumed run")
        )
    if (d / "chaos" / "verdict.json").exists():
        sections.append(chaos_section(d / "chaos", "chaos") + "\n\n" + chaos_goodput(d / "chaos"))
    if (d / "checks.json").exists():
        sections.append(checks_section(json.loads((d / "checks.json").read_text())["rows"]))
    if (d / "inference" / "inference.md").exists():
        sections.append((d / "inference" / "inference.md").read_text())
    return (
        "# tpulab evidence report\n\nBuilt from the evidence in this directory.\n\n"
        + "\n\n".join(sections)
        + "\n"
    )


def chaos_goodput(chaos_dir: Path) -> str:
    from tpulab.evidence.goodput import chaos_kill_tail

    v = json.loads((chaos_dir / "verdict.json").read_text())
    tail = chaos_kill_tail(chaos_dir / "victim", v.get("kill_log", []))
    return goodput_section(
        chaos_dir / "victim", "Goodput of the chaos victim (all lifetimes, kills included)", tail
    )


def write_reports(out_dir: Path, text: str, title: str = "tpulab report") -> tuple[Path, Path]:
    """report.md and the self-contained report.html beside it, from the same Markdown."""
    from tpulab.checkpoint.files import atomic_write_bytes

    out_dir = Path(out_dir)
    md, page = out_dir / "report.md", out_dir / "report.html"
    atomic_write_bytes(md, text.encode())
    atomic_write_bytes(page, render_html(text, out_dir, title).encode())
    return md, page
