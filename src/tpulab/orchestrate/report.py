"""The evidence report: Markdown sections (provenance, the run, curves, goodput, the proof, chaos,
the checks, post-training) and one self-contained HTML page with the same content.

report.html is rendered from the very Markdown written to report.md (one source, so the two cannot
disagree), with every image embedded as a data URI and no script, font or style fetched from
anywhere: it opens offline, from a mail attachment or an artifact store. ``build_report(dir)``
assembles the report from the evidence already on disk (a run dir, a prove-resume dir or a
capstone dir).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tpulab.checkpoint import rundir
from tpulab.checkpoint.rundir import RunDir, RunEnv, read_json
from tpulab.evidence import report_kit
from tpulab.evidence.html import render_html
from tpulab.evidence.metrics import METRICS, curve, read_records, starts
from tpulab.evidence.provenance import hardware_label
from tpulab.orchestrate import default_size, recipe
from tpulab.proofs.checks import table_markdown


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


def provenance_section(env: RunEnv) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env.packages.items() if v)
    return "\n".join(
        [
            "## What this ran on",
            "",
            f"- Hardware: **{hardware_label(env.backend, env.device_kind, env.device_count)}** "
            f"(as JAX reported it: backend `{env.backend}`, "
            f"device kind `{env.device_kind}`, {env.device_count} device(s), "
            f"{env.process_count} process(es))",
            f"- Python {env.python} on {env.platform}",
            f"- Versions: {versions}",
            f"- Commit: `{env.git_commit or 'not a git checkout'}`",
            f"- Date (UTC): {env.time_utc}",
        ]
    )


def run_section(run_dir: Path) -> str:
    rd = RunDir(run_dir)
    env, summary, docs = rd.read_env(), rd.read_summary(), rd.read(rundir.DOCUMENTS)
    prec = env.precision
    unit, per_step = _work(env)
    tps = steady_tokens_per_s(run_dir, per_step)
    # str(), not RunDir.manifest's int(): a run that saved no checkpoint has None here, and its
    # report says "missing" instead of raising
    manifest = rd.checkpoints / str(summary.latest_checkpoint) / rundir.MANIFEST
    from tpulab.checkpoint.files import sha256_file

    rows = [
        (
            "precision policy",
            f"params {prec['param_dtype']}, compute {prec['compute_dtype']}, "
            f"accumulation {prec['accum_dtype']}",
        ),
        ("objective", f"`{env.objective}`"),
        ("shapes", _shapes(env.shapes)),
        ("parameters", f"{env.param_count:,}"),
        ("steps", summary.final_step),
        ("final train loss", f"{summary.final_loss:.4f}"),
        (
            "final validation loss",
            f"{summary.final_val_loss:.4f} (held-out whole documents)"
            if summary.final_val_loss is not None
            else "n/a (the objective evaluates no val_loss)",
        ),
        (
            "steady-state throughput",
            f"{tps:,.0f} {unit}/s (median over steps, compile and warm-up excluded)"
            if tps
            else "n/a",
        ),
        ("time to first step (incl. compile)", f"{summary.time_to_first_step_s:.1f} s"),
        _data_row(docs, env),
        (
            "final checkpoint",
            f"step {summary.latest_checkpoint}, manifest sha256 `{sha256_file(manifest)[:16]}…`"
            if manifest.exists()
            else "missing",
        ),
    ]
    return report_kit.section("The training run", report_kit.table(["what", "value"], rows))


def _work(env: RunEnv) -> tuple[str, int]:
    """The run's unit of work and how many a step takes (the objective's ``run_facts``); a run
    written before they were recorded is a byte-LM run: tokens, batch x seq_len."""
    work = env.details.get("work")
    if isinstance(work, dict):
        return str(work["unit"]), int(work["per_step"])
    return "tokens", env.shapes["batch"] * env.shapes["seq_len"]


def _shapes(shapes: dict) -> str:
    if {"seq_len", "d_model", "n_layers", "n_heads", "vocab"} <= shapes.keys():  # a Transformer's
        return (
            f"batch {shapes['batch']} × sequence {shapes['seq_len']}; "
            f"d_model {shapes['d_model']}, {shapes['n_layers']} layers, {shapes['n_heads']} "
            f"heads, vocab {shapes['vocab']} (bytes + BOS + PAD)"
        )
    return ", ".join(f"{k} {v}" for k, v in shapes.items())


def _data_row(docs: dict, env: RunEnv) -> tuple[str, str]:
    if {"source", "train_documents", "validation_documents"} <= docs.keys():  # a corpus
        return (
            "corpus",
            f"{docs['source']}: {len(docs['train_documents'])} train / "
            f"{len(docs['validation_documents'])} validation documents, "
            f"identity `{docs['identity'][:16]}…`",
        )
    described = ", ".join(f"{k} {v}" for k, v in docs.items() if isinstance(v, (str, int)))
    return ("data", f"{described}; identity `{env.identities.get('data', '?')[:16]}…`")


def proof_section(proof_dir: Path, rel: str) -> str:
    v = RunDir(proof_dir).read_verdict()
    verdict = (
        "**bitwise identical**"
        if v.identical
        else f"**NOT identical** (first differing step {v.first_differing_step})"
    )
    return "\n".join(
        [
            "## Kill/resume proof",
            "",
            f"A second run with the same config was killed with **{v.signal}** right after "
            f"step {v.kill_step} (a real process; no handler ran). A fresh process resumed from "
            f"the newest valid checkpoint, step {v.resumed_from_step}, redid "
            f"{v.details['steps_redone']} steps and trained to step {v.steps}.",
            "",
            f"Verdict: {verdict} against the uninterrupted run: {v.summary}; "
            f"max |diff| = {v.max_abs_diff:g}. Checkpoint dir at the kill: "
            f"{', '.join(v.details.get('checkpoints_at_kill', [])) or 'n/a'}.",
            "",
            f"![overlay]({rel}/overlay.png)",
            "",
            f"Evidence: `{rel}/{rundir.VERDICT}`, per-step losses in each run's `{METRICS}`.",
        ]
    )


def chaos_section(chaos_dir: Path, rel: str) -> str:
    v = RunDir(chaos_dir).read_verdict()
    d = v.details
    return "\n".join(
        [
            "## Chaos: SIGKILL at random moments",
            "",
            f"The run was SIGKILLed **{d['kills']}** times at random wall-clock moments "
            f"(seed {d['seed']}; no hold, no withheld marker), {d['kills_during_save']} of them "
            "while a checkpoint save was in flight, and resumed each time in a fresh process "
            f"({d['segments']} process lifetimes; resumed from steps "
            f"{', '.join(str(s) for s in d['resumed_from_steps'])}).",
            "",
            f"Verdict: **{'identical' if v.identical else 'NOT identical'}**: {v.summary}.",
            "",
            f"![chaos]({rel}/segments.png)",
            "",
            f"Evidence: `{rel}/{rundir.VERDICT}`, the victim's `{METRICS}` "
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
    val = {r["step"]: r["val_loss"] for r in recs if r.get("event") == "eval" and "val_loss" in r}
    if not loss:
        return "## Training curves\n\nNo step was logged."
    with report_kit.figure(out_png, dpi=100, figsize=(8, 4)) as (_, ax):
        _draw_curves(ax, recs, loss, val)
    return f"## Training curves\n\n![training and validation loss]({rel})"


def audits_section(run_dir: Path) -> tuple[str | None, list[str]]:
    """The objective's audits (audits.json) as a table, and the names of those that failed (the
    curves are not shown then); (None, []) for a run without audits."""
    audits = read_json(RunDir(run_dir).audits, None)
    if audits is None:
        return None, []
    failed = sorted(name for name, a in audits.items() if not a.get("passed"))
    rows = [
        [
            name,
            "passed" if a.get("passed") else "FAILED",
            "; ".join(f"{k}: {v}" for k, v in a.items() if k != "passed"),
        ]
        for name, a in audits.items()
    ]
    title = f"Audits, run before step 1 ({rundir.AUDITS})"
    return report_kit.section(
        title, report_kit.table(["audit", "result", "measured"], rows)
    ), failed


def _draw_curves(ax, recs: list[dict], loss: dict, val: dict) -> None:
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


def goodput_section(run_dir: Path, title: str, kill_tail_s: float = 0.0) -> str:
    from tpulab.evidence.goodput import goodput, markdown

    return markdown(goodput(run_dir, kill_tail_s), title)


def find_run_dir(d: Path) -> Path | None:
    for cand in (d, d / "run", RunDir(d).proof.reference.root):
        if RunDir(cand).env.exists() and RunDir(cand).metrics.exists():
            return cand
    return None


def build_report(d: str | Path) -> str:
    """The report Markdown for whatever evidence ``d`` holds (links relative to ``d``)."""
    from tpulab.errors import TpulabError

    d = Path(d)
    if not d.is_dir():
        raise TpulabError(f"{d} is not a directory")
    run_dir = find_run_dir(d)
    proof, chaos = RunDir(d).proof, RunDir(d).chaos
    seeds = d / "seeds.md"  # tpulab seeds: its section, written with its figure
    if run_dir is None and not any(p.exists() for p in (proof.verdict, chaos.verdict, seeds)):
        raise TpulabError(
            f"{d} holds no run ({rundir.ENV} and {METRICS}), proof, chaos or seeds evidence"
        )
    sections = []
    if run_dir is not None:
        rel = run_dir.relative_to(d).as_posix()
        sections.append(provenance_section(RunDir(run_dir).read_env()))
        if RunDir(run_dir).summary.exists():
            sections.append(run_section(run_dir))
        else:
            sections.append(
                f"## The training run\n\nNo {rundir.SUMMARY}: this run has not ended normally yet."
            )
        audits, failed = audits_section(run_dir)
        sections += [audits] if audits else []
        sections.append(
            curves_section(run_dir, d / "plots" / "curves.png", "plots/curves.png")
            if not failed
            else f"## Training curves\n\nNot shown: audit {', '.join(failed)} failed."
        )
        sections.append(goodput_section(run_dir, f"Goodput of `{rel or '.'}`"))
    if proof.verdict.exists():
        sections.append(
            proof_section(proof.root, rundir.PROOF)
            + "\n\n"
            + goodput_section(proof.interrupted.root, "Goodput of the killed-and-resumed run")
        )
    if chaos.verdict.exists():
        sections.append(
            chaos_section(chaos.root, rundir.CHAOS) + "\n\n" + chaos_goodput(chaos.root)
        )
    if seeds.exists():
        sections.append(seeds.read_text())
    if (d / "checks.json").exists():
        sections.append(checks_section(read_json(d / "checks.json")["rows"]))
    if (d / "inference" / "inference.md").exists():
        sections.append((d / "inference" / "inference.md").read_text())
    if (d / "posttrain" / "posttrain.md").exists():
        sections.append((d / "posttrain" / "posttrain.md").read_text())
    if (d / "posttrain" / "chain" / "chain.md").exists():  # the preference chain (its links: d)
        sections.append((d / "posttrain" / "chain" / "chain.md").read_text())
    return (
        "# tpulab evidence report\n\nBuilt from the evidence in this directory.\n\n"
        + "\n\n".join(sections)
        + "\n"
    )


def chaos_goodput(chaos_dir: Path) -> str:
    from tpulab.evidence.goodput import chaos_kill_tail

    victim = RunDir(chaos_dir).victim.root
    tail = chaos_kill_tail(victim, RunDir(chaos_dir).read_verdict().details.get("kill_log", []))
    return goodput_section(
        victim, "Goodput of the chaos victim (all lifetimes, kills included)", tail
    )


def write_reports(out_dir: Path, text: str, title: str = "tpulab report") -> tuple[Path, Path]:
    """report.md and the self-contained report.html beside it, from the same Markdown."""
    from tpulab.checkpoint.files import atomic_write_bytes

    out_dir = Path(out_dir)
    md, page = out_dir / "report.md", out_dir / "report.html"
    atomic_write_bytes(md, text.encode())
    atomic_write_bytes(page, render_html(text, out_dir, title).encode())
    return md, page


def _checkpoint_bytes(run_dir: Path) -> int:
    """Bytes on disk of a run's newest checkpoint (a LoRA run's holds its adapters alone)."""
    from tpulab.train.restore import checkpoint_dir

    return sum(p.stat().st_size for p in checkpoint_dir(run_dir).rglob("*") if p.is_file())


def posttrain_curves(runs: dict[str, Path], evals: dict[str, dict], out_png: Path) -> None:
    """Training loss (per step) and validation response loss of each post-training run, the
    validation curve starting at step 0 with the base's loss on the same batches."""
    # both runs validate on the same batches (same data config): one step-0 point, the base's
    base_val = next(
        e["models"]["base"]["val_loss"] for e in evals.values() if "base" in e["models"]
    )
    with report_kit.figure(out_png, dpi=100, figsize=(8, 4)) as (_, ax):
        _draw_posttrain(ax, runs, base_val)


def _draw_posttrain(ax, runs: dict[str, Path], base_val: float) -> None:
    for (name, run_dir), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        recs = read_records(run_dir)
        loss = curve(recs, "loss")
        xs = sorted(loss)
        ax.plot(xs, [loss[s] for s in xs], lw=0.8, alpha=0.5, color=color, label=f"{name}: train")
        val = {0: base_val}
        val |= {r["step"]: r["val_loss"] for r in recs if r.get("event") == "eval"}
        vs = sorted(val)
        ax.plot(vs, [val[s] for s in vs], "o-", color=color, label=f"{name}: held-out response")
    ax.set_xlabel("step (0: the pretrained base)")
    ax.set_ylabel("response loss (nats per byte)")
    ax.legend(fontsize=8)


def posttrain_section(
    d: Path, runs: dict[str, Path], evals: dict, merges: dict[str, dict], rel: str
) -> str:
    """The capstone's post-training section: the recipe's two fine-tuning runs (full, then LoRA:
    ``recipe.finetune``), their evaluation against the base, the LoRA run's merge (``merges``:
    stage name -> ``merge_lora``'s record), curves and sample generations (links relative to
    ``d.parent``)."""
    from tpulab.evidence.provenance import describe_hardware
    from tpulab.posttrain.evaluate import TRAINED

    (full, sft), (adapted, lora) = evals.items()
    merge = merges[adapted]
    stop, ds, prov = sft["stop"], sft["dataset"], sft["provenance"]
    posttrain_curves(runs, evals, d / "curves.png")
    names = {
        name: recipe.finetune()[name]["title"] + (f" r{e['lora']['rank']}" if e["lora"] else "")
        for name, e in evals.items()
    }
    train_rows = []
    for name, run_dir in runs.items():
        rd = RunDir(run_dir)
        env, summary = rd.read_env(), rd.read_summary()
        link = rd.read(rundir.MLFLOW_RUN, {})
        sh = env.shapes
        tps = steady_tokens_per_s(run_dir, sh["batch"] * sh["seq_len"])
        train_rows.append(
            (
                names[name],
                f"{env.trained_param_count:,} of {env.param_count:,}",
                f"{env.optimizer_state_bytes / 2**20:.2f} MiB",
                f"{_checkpoint_bytes(run_dir) / 2**20:.2f} MiB",
                summary.final_step,
                f"{summary.final_loss:.4f}",
                f"{tps:,.0f}" if tps else "n/a",
                str(link.get("run_id", "-"))[:12],
            )
        )

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def eval_row(label, m):
        stop_at, val = m["median_stop_bytes"], m.get("val_loss")
        return (
            label,
            f"{m['response_loss']:.4f}",
            "-" if val is None else f"{val:.4f}",
            pct(m["stop_accuracy"]),
            f"{m['stop_probability']:.3f}",
            pct(m["stop_rate"]),
            pct(m["stop_rate_in_room"]),
            "-" if stop_at is None else f"{stop_at:.0f}",
        )

    mg = lora["merged"]
    samples = []
    for i, s in enumerate(sft["samples"]):
        lo = lora["samples"][i]
        samples += [
            "```",
            f"[{s['source']}] prompt:",
            s["prompt"].rstrip("\n"),
            f"--- reference: {s['reference']}",
            f"--- base:      {s['base']!r} (stop: {s['base_stop_bytes'] or 'none'})",
            f"--- full SFT:  {s[TRAINED]!r} (stop: {s[f'{TRAINED}_stop_bytes'] or 'none'})",
            f"--- LoRA:      {lo[TRAINED]!r} (stop: {lo[f'{TRAINED}_stop_bytes'] or 'none'})",
            "```",
            "",
        ]
    return "\n".join(
        [
            "## Post-training: SFT and LoRA from the pretrained run",
            "",
            default_size.mechanics_label(
                "full SFT and LoRA train from the pretrained run through the one loop, each "
                "checkpoint naming its base; the LoRA merge reproduces the adapter's logits; the "
                "held-out evaluation (response loss, stop rate, samples) runs end to end and is "
                "logged to MLflow.",
                "in the preference chain's section below, read from the committed results file",
            ),
            "",
            f"Both runs start from step {sft['base']['step']} of `run/` (manifest "
            f"`{sft['base']['digest'][:16]}`, recorded in every checkpoint of theirs) and train "
            f"on the dialogue pairs cut from the training plays (dataset `{ds['identity'][:16]}`); "
            f"everything below is measured on the {ds['eval_pairs']:,} pairs of the held-out "
            f"plays ({', '.join(ds['eval_sources'][:4])}"
            f"{' …' if len(ds['eval_sources']) > 4 else ''}), "
            f"which the pretraining run held out too. On {describe_hardware(prov)}; "
            f"params/compute/accumulation {prov['dtypes']['param_dtype']}/"
            f"{prov['dtypes']['compute_dtype']}/{prov['dtypes']['accum_dtype']}; jax "
            f"{prov['packages']['jax']}; commit `{prov['git_commit']}`.",
            "",
            report_kit.table(
                [
                    "run",
                    "trained params",
                    "optimizer state",
                    "newest checkpoint on disk",
                    "steps",
                    "final train loss",
                    "steady tokens/s",
                    "MLflow run",
                ],
                train_rows,
            ),
            "",
            f"Response loss: mean NLL per response byte, the stop byte included (the SFT "
            f"objective's masked loss on the deterministic forward), over {ds['loss_pairs']:,} "
            f"held-out pairs spread over the set ({ds['response_tokens']:,} response bytes); "
            f"validation loss: the objective's own eval step on the {ds['val_pairs']} pairs of "
            "the runs' validation batches (what their curves log; the run's equals its last "
            "logged value). At the stop: teacher-forced on the held-out pairs, at the target "
            "after the reference response, how often ETX is the most likely next byte and its "
            f"mean probability. Stop rate: greedy generations from {stop['prompts']} held-out "
            f"prompts (the compiled batched loop, {stop['cache_policy']} cache), each with room "
            f"for {stop['room']} new bytes, that emit the stop byte ETX within "
            f"**N = {stop['max_new']}** bytes; and within the whole room (a model trained on "
            "pairs that all end inside the context learns to stop as it runs out). "
            f"{stop['skipped_prompts']} prompts left out (no room for {stop['room']} bytes).",
            "",
            report_kit.table(
                [
                    "model",
                    "response loss",
                    "validation loss",
                    "ETX top-1 at the stop",
                    "P(ETX) at the stop",
                    "stop rate (N)",
                    "stop within the room",
                    "median bytes to stop",
                ],
                [
                    eval_row("base (pretrained, step 0)", sft["models"]["base"]),
                    eval_row(names[full], sft["models"][TRAINED]),
                    eval_row(names[adapted], lora["models"][TRAINED]),
                    eval_row(f"{names[adapted]} merged", lora["models"]["merged"]),
                    ("the reference responses", "-", "-", "-", "-", pct(stop["reference_rate"]))
                    + ("-", "-"),
                ],
            ),
            "",
            f"Merge (`tpulab merge-lora`, W = W0 + (alpha/r)·A·B in float32, "
            f"{merge['adapted_matrices']} matrices, {merge['merge_seconds']:.3f} s): merged "
            f"against adapter logits within **{merge['max_relative_logit_diff']:.2g}** relative "
            f"(bound {merge['bound']:g}); "
            + (
                f"greedy generations identical on **{mg['identical_generations']} of "
                f"{mg['generations']}** held-out prompts."
                if mg["generations"]
                else "no held-out prompt leaves room to compare generations at this size."
            ),
            "",
            f"![post-training curves]({rel}/curves.png)",
            "",
            "Sample generations (greedy; the response is what follows the prompt):",
            "",
            *samples,
            f"Evidence: `{rel}/eval_{full}.json`, `{rel}/eval_{adapted}.json` (also in each run's "
            f"MLflow run, with its numbers as `eval.*` metrics), `{rel}/{adapted}-merged/"
            f"merge.json`, the runs `{rel}/{full}/` and `{rel}/{adapted}/`.",
        ]
    )
