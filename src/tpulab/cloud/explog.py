"""``DIR/experiment.md`` (and ``experiment.html``, the same as one self-contained page): the cloud
run's log, every line pointing at the raw evidence it came from.

It is assembled only from files the lifecycle wrote (what gcloud and the workers' runtimes
reported), never from the config's intentions. The hardware is named from the workers' receipts:
without a receipt whose backend is tpu, the log does not say TPU.
"""

from __future__ import annotations

from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes
from tpulab.checkpoint.rundir import METRICS, RunDir, read_json
from tpulab.cloud.gcloud import read_calls
from tpulab.evidence.html import render_html
from tpulab.evidence.metrics import read_records
from tpulab.evidence.receipt import hardware_line
from tpulab.evidence.report_kit import figure, table

LOG = "experiment.md"
HTML = "experiment.html"  # the same log as one self-contained page (the curve embedded)
CURVE = "curve.png"


def _receipts(out: Path) -> list[tuple[int, Path, dict]]:
    found = []
    for p in sorted(out.glob("workers/*/*/receipt/receipt*.json")):
        found.append((int(p.parts[-4]), p, read_json(p)))
    return found


def _source(fetched: dict) -> str:
    return fetched.get("source") or f"worker {fetched['worker']}"


def plot_curves(out: Path, run_name: str, path: Path) -> bool:
    """Loss per step for every worker and segment, the preemption and the resume marked."""
    series, marks, lines = [], [], []  # lines: (step, colour, style) of preemptions, resumes
    dirs = [(f"worker {d.name}", d / run_name) for d in sorted((out / "workers").glob("*"))]
    dirs.append(
        ("shared run dir", out / "shared" / run_name)
    )  # one multi-process job's metrics (process 0)
    for w, (label, run_dir) in enumerate(d for d in dirs if RunDir(d[1]).metrics.exists()):
        records = read_records(RunDir(run_dir).metrics)
        for seg in sorted({r["segment"] for r in records if "step" in r}):
            pts = sorted(
                (r["step"], r["loss"]) for r in records if r.get("segment") == seg and "loss" in r
            )
            if pts:
                series.append((w, f"{label}, segment {seg}" + (" (resumed)" if seg else ""), pts))
        for r in records:
            if r.get("event") == "preempted":
                lines.append((r["step"], "red", "--"))
                marks.append(f"{label}: SIGTERM, saved at step {r['step']}")
            if r.get("event") == "start" and r.get("resumed_from") is not None:
                lines.append((r["resumed_from"], "green", ":"))
                marks.append(f"{label}: resumed from step {r['resumed_from']}")
    if not series:
        return False
    with figure(path, figsize=(8, 4.5)) as (_, ax):
        for w, label, pts in series:
            ls, marker = ("-", ".") if w == 0 else ("--", "x")
            ax.plot(*zip(*pts), ls=ls, marker=marker, ms=3, lw=1, label=label)
        for step, color, ls in lines:
            ax.axvline(step, color=color, ls=ls, lw=0.8)
        if marks:
            ax.text(
                0.02,
                0.02,
                "\n".join(marks),
                transform=ax.transAxes,
                fontsize=7,
                va="bottom",
                color="darkred",
            )
        ax.set(
            xlabel="step",
            ylabel="training loss",
            title="Cloud run: loss per step (preemption and resume marked)",
        )
        ax.legend(fontsize=7)
    return True


def write_experiment_log(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    cloud = out / "cloud"
    resource = read_json(cloud / "resource.json", None)
    staged = read_json(cloud / "staged.json", None)
    run = read_json(cloud / "run.json", None)
    fetch = read_json(cloud / "fetch.json", None)
    cleanup = read_json(cloud / "cleanup.json", None)
    calls = read_calls(cloud)
    receipts = _receipts(out)
    on_tpu = bool(receipts) and all(r["runtime"]["backend"] == "tpu" for _, _, r in receipts)
    lines = ["# Cloud experiment log", ""]
    if receipts:
        hw = sorted({hardware_line(r) for _, _, r in receipts})
        counts = sorted({r["runtime"]["process_count"] for _, _, r in receipts})
        job = (
            f" (global devices of one {counts[0]}-process JAX job)"
            if counts != [1] and len(counts) == 1
            else " (each worker its own single-process JAX runtime)"
            if counts == [1]
            else f" (process counts disagree: {counts})"
        )
        lines.append(f"Hardware, from {len(receipts)} worker receipt(s): {'; '.join(hw)}{job}.")
    else:
        lines.append(
            "Hardware: no runtime receipt was retrieved, so this log names no accelerator."
        )
    lines += ["", "## Resource (cloud/resource.json, from `describe --format=json`)", ""]
    if resource:
        for key in (
            "project",
            "zone",
            "name",
            "full_name",
            "id",
            "accelerator_type",
            "runtime_version",
            "state",
            "create_time",
            "spot",
            "preemptible",
        ):
            lines.append(f"- {key}: `{resource.get(key)}`")
        eps = [e.get("ipAddress") for e in resource.get("network_endpoints") or []]
        lines.append(f"- network endpoints ({len(eps)} workers): {', '.join(map(str, eps))}")
        if not on_tpu:
            lines.append(
                "- the accelerator type above is what the cloud reported for the resource; no "
                "receipt from its runtime confirms it"
            )
    else:
        lines.append("- none recorded (create did not complete)")
    lines += ["", "## Staged code (cloud/staged.json)", ""]
    if staged:
        lines.append(
            f"- wheel `{staged['wheel']}` sha256 `{staged['wheel_sha256']}`, built from commit "
            f"`{staged['tpulab_commit']}`; jax {staged['jax_version']}"
        )
        lines.append(
            f"- config `{staged['config']}` (sha256 `{staged['config_sha256']}`), "
            f"data `{staged['data']}`"
        )
    else:
        lines.append("- not staged")
    lines += ["", "## Worker receipts (target qualification before the job)", ""]
    if run:
        lines.append(f"Target: `{run['target']}`.")
    for worker, path, r in receipts:
        q = r.get("qualification", {})
        ev, rt, mm = r["evidence"], r["runtime"], r["evidence"]["matmul"]
        lines.append(
            f"- worker {worker}: {hardware_line(r)}, platform {rt['platform_version']}, "
            f"process {rt['process_index']}/{rt['process_count']}, host {r['host']}; "
            f"collective {'pass' if ev['collective']['passed'] else 'FAIL'}"
            f"{' (trivial: 1 device)' if ev['collective'].get('trivial') else ''}, matmul "
            f"{'pass' if mm['passed'] else 'FAIL'} ({mm['tflops_best']:.3f} TFLOP/s "
            f"{mm['dtype']} {mm['shape']}), round trip "
            f"{'pass' if ev['round_trip']['passed'] else 'FAIL'}; qualified as "
            f"`{q.get('target')}`: {q.get('passed')} ([receipt]({path.relative_to(out)}))"
        )
    if not receipts:
        lines.append("- no receipt retrieved")
    lines += ["", f"## Job and training curve (cloud/run.json, workers/*/RUN/{METRICS})", ""]
    if run:
        lines.append(
            f"- job: `tpulab {' '.join(run['job'])}` in `{run['run_dir']}`, "
            f"env {run['env'] or '{}'}, per-worker env {run['worker_env'] or '{}'}"
        )
        rehearsal = (
            "not requested" if run["preempt_at"] is None else f"SIGTERM at step {run['preempt_at']}"
        )
        lines.append(
            f"- preemption rehearsal: {rehearsal}; "
            f"segments run: {', '.join(run['segments']) or 'none'}"
        )
        name = Path(run["run_dir"]).name
        if plot_curves(out, name, out / CURVE):
            lines.append(f"- ![loss per step]({CURVE})")
    if run and run.get("shared_dir"):
        lines.append(
            f"- shared run dir `{run['run_dir']}` (cloud.shared_dir `{run['shared_dir']}`): one "
            "directory for every process; a marker written on worker 0 was read back on every "
            "worker before the job"
        )
    if fetch:
        for w in fetch["workers"]:
            lines.append(
                f"- {_source(w)}: {w['segments']} segment(s), preempted at "
                f"{w['preempted_at'] or '-'}, "
                f"resumed from {[s for s in w['resumed_from'] if s is not None] or '-'}, "
                f"final step {w['final_step']}"
            )
    lines += ["", "## Retrieved checkpoints, verified here (cloud/fetch.json)", ""]
    if fetch:
        for w in fetch["workers"]:
            for c in w["checkpoints"]:
                lines.append(
                    f"- {_source(w)} `{c['path']}`: "
                    + (
                        f"manifest verified, sha256 `{c['manifest_sha256'][:16]}…`"
                        if c["verified"]
                        else f"FAILED: {c['error']}"
                    )
                )
        if fetch.get("salvage"):
            lines.append("- salvaged after the failure (receipts, partial metrics): not a result")
        else:
            verdict = (
                "all retrieved checkpoints verify" if fetch["passed"] else "VERIFICATION FAILED"
            )
            lines.append(f"- verdict: {verdict}")
    else:
        lines.append("- nothing fetched")
    lines += ["", "## Cleanup (cloud/cleanup.json)", ""]
    if cleanup:
        if cleanup.get("nothing_created"):
            lines.append("- create left nothing behind: describe reports NOT_FOUND")
        else:
            names = cleanup["listed_names"]
            lines.append(
                f"- delete exit {cleanup['delete_rc']}; describe after delete: "
                f"{cleanup['describe']}; list exit {cleanup['list_rc']}, shows it: "
                f"{None if names is None else cleanup['name'] in names}"
            )
        lines.append(f"- verified gone: **{cleanup['verified_gone']}**")
    else:
        lines.append("- not deleted yet (run `tpulab tpu delete`)")
    lines += [
        "",
        "## Every gcloud call (cloud/calls.jsonl)",
        "",
        table(
            ["#", "step", "exit", "seconds", "command"],
            [
                (i, c["step"], c["rc"], c["duration_s"], f"`{c['command']}`")
                for i, c in enumerate(calls)
            ],
        ),
    ]
    text = "\n".join(lines) + "\n"
    path = out / LOG
    atomic_write_bytes(path, text.encode())
    atomic_write_bytes(out / HTML, render_html(text, out, "tpulab cloud experiment log").encode())
    return path
