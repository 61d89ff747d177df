"""The kill/resume proof, shared by both capstones.

A reference run trains N steps in its own process. A second run with the same config is started
in a subprocess, held right after step K (its trainer's hidden ``--hold-after-step K`` flag
installs the ``HoldAfter`` hook, so the kill lands between checkpoints at a known step) and killed
with SIGKILL: no handler runs, nothing is flushed or saved. A fresh process, with a fresh, empty
compilation cache (``proofs.cache``), then resumes from the newest valid checkpoint and trains to N.
The per-step losses of each segment are compared with the reference exactly (``==`` on the float32
values), each on its own, and the overlay is plotted. Trainers only need to (1) log per-step
``loss`` to metrics.jsonl through ``MetricsLog`` with ``resumed_from`` in its start record and (2)
accept ``--hold-after-step`` and ``--cache-stats``. ``tpulab chaos`` (proofs.chaos) kills at random
moments instead, with no hold.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tpulab.checkpoint.rundir import ResumeVerdict, RunDir
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import METRICS, curve, read_records, starts
from tpulab.evidence.report_kit import figure
from tpulab.proofs import cache

HOLD_FLAG = "--hold-after-step"  # every trainer the driver starts accepts it (hidden from --help)


def compare_curves(reference: dict[int, float], other: dict[int, float]) -> dict:
    """Exact per-step comparison over the steps both curves have."""
    steps = sorted(set(reference) & set(other))
    diffs = [abs(reference[s] - other[s]) for s in steps]
    first = next((s for s, d in zip(steps, diffs) if not d == 0.0 or math.isnan(d)), None)
    return {
        "identical": bool(steps) and first is None,
        "max_abs_diff": max(diffs) if diffs else float("nan"),
        "first_differing_step": first,
        "steps_compared": len(steps),
    }


class Proc:
    """A child in its own process group, killed with its whole group on exit, whatever happens.
    Live ones are also in ``Proc.live``, so a caller whose stages run in threads can kill them
    all from the main thread (``kill_live``): Ctrl-C reaches only that thread, and a child in its
    own session never sees the terminal's SIGINT."""

    live: set[Proc] = set()
    _lock = threading.Lock()

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        with Proc._lock:
            self.p = subprocess.Popen(
                argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            Proc.live.add(self)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
        self.p.wait()

    def wait(self, timeout_s: float, late: str) -> int:
        """The exit code; a one-line refusal ``late`` when it runs past ``timeout_s``."""
        try:
            return self.p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TpulabError(late) from None

    def tail(self, n: int = 15) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        self._log.close()
        with Proc._lock:
            Proc.live.discard(self)


def kill_live() -> None:
    """SIGKILL every live ``Proc``'s process group and reap it (the threads that own them then
    see their child end and unwind, closing each one)."""
    with Proc._lock:
        procs = list(Proc.live)
    for proc in procs:
        proc.kill()


def fresh_run_dir(run_dir: Path, exist_ok: bool = False) -> Path:
    """``run_dir``, made; refused in one line when it already holds a run."""
    if (run_dir / METRICS).exists():
        raise TpulabError(f"{run_dir} already holds a run; use a fresh --run-dir")
    run_dir.mkdir(parents=True, exist_ok=exist_ok)
    return run_dir


def run_to_completion(
    argv: list[str], log_path: Path, env: dict, timeout_s: float, what: str
) -> None:
    with Proc(argv, log_path, env) as proc:
        rc = proc.wait(
            timeout_s, f"{what} did not finish within {timeout_s:.0f}s (log: {log_path})"
        )
        if rc != ExitCode.OK:
            raise TpulabError(f"{what} exited with {rc}: {proc.tail(1)} (log: {log_path})")


def run_and_kill(
    argv: list[str], run_dir: Path, log_path: Path, env: dict, kill_at: int, timeout_s: float
) -> int:
    """Start a run held after ``kill_at``; SIGKILL it once that step is logged.
    Returns the last logged step."""
    with Proc([*argv, HOLD_FLAG, str(kill_at)], log_path, env) as proc:
        deadline = time.monotonic() + timeout_s
        while True:
            logged = curve(read_records(run_dir / METRICS))
            if kill_at in logged:
                break
            if proc.p.poll() is not None:
                raise TpulabError(
                    f"run to be killed exited with {proc.p.returncode} before step {kill_at}: "
                    f"{proc.tail(1)} (log: {log_path})"
                )
            if time.monotonic() > deadline:
                raise TpulabError(
                    f"run to be killed did not reach step {kill_at} within {timeout_s:.0f}s"
                )
            time.sleep(0.05)
        proc.kill(signal.SIGKILL)
        if proc.p.returncode != -signal.SIGKILL:
            raise TpulabError(f"killed run ended with {proc.p.returncode}, not SIGKILL")
    return max(curve(read_records(run_dir / METRICS)))


def checkpoint_listing(run_dir: Path) -> list[str]:
    """What the checkpoint dir held at the moment of the kill (evidence of saves cut short)."""
    ckpt = RunDir(run_dir).checkpoints
    return sorted(os.listdir(ckpt)) if ckpt.is_dir() else []


def prove_resume(
    command: Callable[[Path], list[str]],
    proof_dir: str | Path,
    *,
    steps: int,
    kill_at: int,
    reference_dir: str | Path | None = None,
    env: dict | None = None,
    timeout_s: float = 900,
    title: str = "kill/resume proof",
    extra: dict | None = None,
    compare_state: Callable[[Path, Path], dict] | None = None,
    warm_resume_cache: bool = False,
) -> dict:
    """Run the whole proof and write proof_dir/verdict.json and proof_dir/overlay.png.

    ``command(run_dir)`` returns the argv of a trainer that trains ``steps`` steps in ``run_dir``,
    resuming from its newest valid checkpoint when there is one. ``reference_dir`` reuses an
    uninterrupted run that already finished (the capstone's main run) instead of training one.
    ``compare_state(reference_dir, run_dir)`` adds the whole-state verdict
    (``final_state_identical``); then ``identical`` needs both the curves and the final state to
    match. The reference and killed runs use the cache ``env`` names (or the default); the resumed
    process gets a fresh, empty compilation cache, as on a new machine, unless ``warm_resume_cache``
    (then it shares theirs). Every child records its cache hits and misses (``proofs.cache``).
    """
    proof = RunDir(proof_dir)
    proof_dir = proof.root
    if not 0 < kill_at < steps:
        raise TpulabError(f"--kill-at {kill_at} must be between 1 and steps-1 ({steps - 1})")
    proof_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {})}
    timings = {}
    stats_dir = proof_dir / "compile-cache"
    stats_dir.mkdir(exist_ok=True)
    counted = lambda argv, role: [*argv, cache.FLAG, str(stats_dir / f"{role}.json")]  # noqa: E731
    if warm_resume_cache:
        resume_cache, resume_env = None, env
    else:
        resume_cache = cache.fresh_cache(stats_dir, "resumed")
        resume_env = {**env, **cache.cache_env(resume_cache)}

    def to_completion(role: str, run_dir: Path, env: dict) -> float:
        """The ``role`` child trained to the end in ``run_dir``, logged to ``<role>.log``: its
        wall seconds."""
        t0 = time.monotonic()
        argv = counted(command(run_dir), role)
        run_to_completion(argv, proof_dir / f"{role}.log", env, timeout_s, f"{role} run")
        return time.monotonic() - t0

    if reference_dir is None:
        reference_dir = fresh_run_dir(proof.reference.root)
        timings["reference_s"] = to_completion("reference", reference_dir, env)
    reference_dir = Path(reference_dir)

    run_dir = fresh_run_dir(proof.interrupted.root, exist_ok=True)
    t0 = time.monotonic()
    kill_step = run_and_kill(
        counted(command(run_dir), "killed"),
        run_dir,
        proof_dir / "killed.log",
        env,
        kill_at,
        timeout_s,
    )
    at_kill = checkpoint_listing(run_dir)
    timings["killed_run_s"] = time.monotonic() - t0
    timings["resumed_run_s"] = to_completion("resumed", run_dir, resume_env)
    caches = {
        "resumed_cache": "warm (shared with the reference and killed runs)"
        if warm_resume_cache
        else "cold (fresh, empty)",
        "processes": {
            role: cache.read_stats(stats_dir / f"{role}.json")
            for role in ("reference", "killed")
            if (stats_dir / f"{role}.json").exists()
        },
    }
    caches["processes"]["resumed"] = cache.read_stats(
        stats_dir / "resumed.json", resume_cache, cold=not warm_resume_cache
    )
    if resume_cache is not None:
        shutil.rmtree(resume_cache)  # a cache, not evidence: its entry count is recorded

    verdict = judge(reference_dir, run_dir, steps=steps, kill_step=kill_step)
    if compare_state is not None:
        verdict.update(compare_state(reference_dir, run_dir))
        verdict["identical"] = verdict["curves_identical"] and verdict["final_state_identical"]
    verdict.update(
        timings=timings,
        compile_cache=caches,
        reference_dir=str(reference_dir),
        run_dir=str(run_dir),
        checkpoints_at_kill=at_kill,
        **(extra or {}),
    )
    record = typed_verdict("resume", verdict)
    proof.write_verdict(record)
    verdict = record.to_dict()  # the flat dict on disk, for the plot and the callers
    plot_proof(reference_dir, run_dir, verdict, proof_dir / "overlay.png", title=title)
    return verdict


def typed_verdict(kind: str, verdict: dict) -> ResumeVerdict:
    """``verdict`` (judge's fields and the writer's own) as the typed record, with its kind and
    its one-sentence summary; a field no writer of ``kind`` writes is an error here, before the
    file is written. The final state not compared: ``final_state_identical`` None."""
    summary = verdict.get("summary") or verdict_text(verdict)
    return ResumeVerdict.from_dict(
        {"final_state_identical": None, **verdict, "kind": kind, "summary": summary},
        f"the {kind} proof's verdict",
    )


def judge(reference_dir: Path, run_dir: Path, *, steps: int, kill_step: int) -> dict:
    """Each segment against the reference on its own: a killed run that already drifted from the
    reference (run-to-run nondeterminism) is reported before the kill, not blamed on the resume."""
    ref = curve(read_records(reference_dir))
    recs = read_records(run_dir)
    segs = starts(recs)
    if len(segs) < 2:
        raise TpulabError(
            f"{run_dir} holds {len(segs)} run segment(s); expected a killed and a resumed one"
        )
    resumed_from = segs[-1].get("resumed_from")
    if resumed_from is None:
        raise TpulabError(f"the resumed process in {run_dir} did not resume from a checkpoint")
    killed = curve(recs, segment=segs[0]["segment"])
    resumed = curve(recs, segment=segs[-1]["segment"])
    before = compare_curves(ref, killed)
    after = compare_curves(ref, resumed)
    whole = compare_curves(ref, {**killed, **resumed})
    missing = [s for s in range(1, steps + 1) if s not in ref or s not in {**killed, **resumed}]
    identical = before["identical"] and after["identical"] and not missing
    firsts = [
        s for s in (before["first_differing_step"], after["first_differing_step"]) if s is not None
    ]
    return {
        "identical": identical,
        "curves_identical": identical,
        "max_abs_diff": max(before["max_abs_diff"], after["max_abs_diff"]),
        "first_differing_step": min(firsts, default=None),
        "first_differing_step_before_kill": before["first_differing_step"],
        "first_differing_step_after_resume": after["first_differing_step"],
        "steps_compared": whole["steps_compared"],
        "steps_compared_after_resume": after["steps_compared"],
        "steps_redone": max(0, kill_step - resumed_from),
        "missing_steps": missing[:10],
        "kill_step": kill_step,
        "resumed_from_step": resumed_from,
        "signal": "SIGKILL",
        "steps": steps,
    }


def where_curves_differ(verdict: dict) -> str:
    """Which segment differs first: before the kill (the runs diverged on their own) or after it."""
    before = verdict.get("first_differing_step_before_kill")
    after = verdict.get("first_differing_step_after_resume")
    parts = []
    if before is not None:
        parts.append(
            f"the killed run already differs from the reference at step {before}, before the kill "
            "(run-to-run, not the resume)"
        )
    if after is not None:
        parts.append(f"the resumed run differs from step {after}")
    if verdict.get("missing_steps"):
        parts.append(f"steps missing: {verdict['missing_steps']}")
    return "; ".join(parts)


def verdict_text(verdict: dict) -> str:
    """One sentence that says what was compared and how it came out."""
    curves = (
        f"per-step losses bitwise identical over {verdict['steps_compared']} steps"
        if verdict.get("curves_identical", verdict["identical"])
        else f"per-step losses NOT identical (max |diff| {verdict['max_abs_diff']:.3g}"
        + (f": {where}" if (where := where_curves_differ(verdict)) else "")
        + ")"
    )
    if verdict.get("final_state_identical") is None:
        return curves + " (final state not compared)"
    state = (
        "final state bitwise identical"
        if verdict["final_state_identical"]
        else f"final state NOT identical (first differing: {verdict['first_differing_leaf']})"
    )
    return f"{curves}; {state} ({verdict['final_state_compared']})"


def plot_proof(reference_dir: Path, run_dir: Path, verdict: dict, path: Path, title: str) -> None:
    recs = read_records(run_dir)
    segs = starts(recs)
    plot_overlay(
        curve(read_records(reference_dir)),
        curve(recs, segment=segs[0]["segment"]),
        curve(recs, segment=segs[-1]["segment"]),
        verdict,
        path,
        title,
    )


def plot_overlay(
    ref: dict,
    killed: dict,
    resumed: dict,
    verdict: dict,
    path: Path,
    title: str,
    labels: tuple[str, str, str] | None = None,
    marks: tuple[str, str] = ("checkpoint", "kill"),
) -> None:
    """Two panels: the three curves overlaid (checkpoint and kill marked) and
    |resumed - reference|. ``labels`` (reference, first segment, second segment) and ``marks``
    rename them for other proofs."""
    with figure(
        path, nrows=2, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    ) as (_, (ax, ax_d)):
        rs = sorted(ref)
        labels = labels or (
            "reference (uninterrupted)",
            f"killed run (SIGKILL after step {verdict['kill_step']})",
            f"fresh process, resumed from step {verdict['resumed_from_step']}",
        )
        ax.plot(rs, [ref[s] for s in rs], color="0.55", lw=4.0, alpha=0.6, label=labels[0])
        ks = sorted(killed)
        ax.plot(ks, [killed[s] for s in ks], color="tab:blue", lw=1.3, label=labels[1])
        us = sorted(resumed)
        ax.plot(us, [resumed[s] for s in us], color="tab:red", lw=1.3, ls="--", label=labels[2])
        for a in (ax, ax_d):
            a.axvline(verdict["resumed_from_step"], color="tab:green", ls=":", lw=1.2)
            a.axvline(verdict["kill_step"], color="k", ls=":", lw=1.2)
        ax.annotate(
            f" {marks[0]}",
            (verdict["resumed_from_step"], 0.98),
            xycoords=("data", "axes fraction"),
            color="tab:green",
            va="top",
            ha="right",
            fontsize=8,
        )
        ax.annotate(
            f" {marks[1]}",
            (verdict["kill_step"], 0.98),
            xycoords=("data", "axes fraction"),
            va="top",
            fontsize=8,
        )
        ax.set_ylabel("train loss")
        ax.set_title("\n".join(textwrap.wrap(f"{title}: {verdict_text(verdict)}", 90)), fontsize=10)
        ax.legend(fontsize=8)
        both = {
            **killed,
            **resumed,
        }  # where both ran a step, the resumed value is the one that matters
        diff_steps = [s for s in rs if s in both]
        diffs = [abs(both[s] - ref[s]) for s in diff_steps]
        diff_panel(ax_d, diff_steps, diffs, "every step: difference exactly 0")
        ax_d.set_ylabel("|run - reference|")
        ax_d.set_xlabel("step")


def diff_panel(ax, steps: list[int], diffs: list[float], all_zero: str) -> None:
    """The lower panel of a proof's plot: |difference| per step on a symlog axis (exact zeros
    stay visible), and ``all_zero`` written across it when every difference is exactly 0."""
    ax.plot(steps, diffs, color="tab:purple", marker=".", ms=3, lw=0.8)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_ylim(0, max(1e-6, 10 * max(diffs, default=0.0)))
    if diffs and max(diffs) == 0.0:
        ax.text(0.5, 0.5, all_zero, transform=ax.transAxes, ha="center", fontsize=9)


def tpulab_argv(*args: str) -> list[str]:
    """argv of a `tpulab ARGS` child with this interpreter (children use the same venv): the one way
    every proof, capstone and launcher builds a child command line."""
    return [sys.executable, "-m", "tpulab.cli", *map(str, args)]
