"""`tpulab chaos`: SIGKILL a run at random moments, resume it each time, compare everything.

The held kill of ``prove-resume`` is readable but gentle: the process pauses after step K, so
background saves finish before the kill. Here nothing is held and no marker is withheld: a victim
process is killed N times at moments drawn from a seeded RNG (during start-up, restore, a step, or a
save in flight), a fresh process resumes after each kill, and the last one trains to the end. Then
every logged step of every process lifetime is compared with an uninterrupted reference (``==`` on
float32), and so is the final whole state (``proofs.state``). A kill counts as landing mid-save
when the checkpoint dir held, at the moment of the kill, an Orbax temporary dir or a step without
its completion marker that the killed lifetime started (leftovers of an earlier lifetime's cut save
do not count).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

from tpulab.checkpoint.files import MANIFEST
from tpulab.checkpoint.rundir import RunDir
from tpulab.checkpoint.store import TMP_MARK, scan
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import curve, read_records, starts
from tpulab.evidence.report_kit import figure
from tpulab.proofs import cache
from tpulab.proofs.driver import (
    Proc,
    compare_curves,
    diff_panel,
    run_to_completion,
    typed_verdict,
)
from tpulab.proofs.state import final_state_verdict
from tpulab.proofs.transformer import check_reference, train_child_argv, write_child_config
from tpulab.train.config import RunConfig


def saves_in_flight(ckpt_dir: Path) -> dict[str, tuple[int, int]]:
    """Orbax temporary dirs and unmarked step dirs (evidence of a save cut short), each with the
    inode and mtime that tell one save's dir from a later one of the same name."""
    if not ckpt_dir.is_dir():
        return {}
    out = {}
    for p in ckpt_dir.iterdir():
        if TMP_MARK in p.name or (p.is_dir() and p.name.isdigit() and not (p / MANIFEST).exists()):
            try:
                st = p.stat()
            except FileNotFoundError:  # renamed or removed by the live process meanwhile
                continue
            out[p.name] = (st.st_ino, st.st_mtime_ns)
    return out


def saves_started_since(before: dict[str, tuple[int, int]], ckpt_dir: Path) -> list[str]:
    """Saves in flight now that were not there, unchanged, in ``before`` (taken before the lifetime
    started): a previous lifetime's cut-short save, still there when a kill lands during start-up
    (before the store clears it away), is not a kill during this lifetime's save."""
    return sorted(n for n, ident in saves_in_flight(ckpt_dir).items() if before.get(n) != ident)


def run_chaos(
    config: RunConfig,
    out_dir: Path,
    *,
    kills: int = 5,
    seed: int = 0,
    compile_cache: Path | None = None,
    timeout_s: float = 900,
    warm_resume_cache: bool = False,
    reference_dir: Path | None = None,
    env: dict | None = None,
    track: bool = True,
) -> dict:
    """Write out_dir/chaos/{verdict.json, segments.png}; return the verdict.

    The reference and the first victim lifetime use ``compile_cache`` (or the default); every later
    lifetime is a resume and gets a fresh, empty compilation cache, unless ``warm_resume_cache``.
    Each process's cache hits and misses are recorded (``proofs.cache``). ``reference_dir``: an
    uninterrupted finished run of this config to reuse instead of training one (read only).
    ``env`` is added to every child's environment (the capstone's MLflow store); ``track=False``
    passes ``--no-track`` to every child trainer."""
    if kills < 1:
        raise TpulabError(f"--kills {kills} must be at least 1")
    if reference_dir is not None:
        reference_dir = check_reference(Path(reference_dir), config)
    chaos = RunDir(out_dir).chaos
    chaos_dir = chaos.root
    if chaos.verdict.exists() or chaos.victim.root.exists():
        raise TpulabError(f"{chaos_dir} already holds a chaos run; use a fresh --run-dir")
    steps = config.train.steps
    config_path = write_child_config(config, chaos.config)
    stats_dir = chaos_dir / "compile-cache"
    stats_dir.mkdir()

    def argv(run_dir: Path, role: str) -> list[str]:
        return [
            *train_child_argv(config_path, run_dir, extra=() if track else ("--no-track",)),
            cache.FLAG,
            str(stats_dir / f"{role}.json"),
        ]

    env = {**os.environ, **(env or {}), **(cache.cache_env(compile_cache) if compile_cache else {})}
    processes: dict[str, dict] = {}

    reference, victim = reference_dir or chaos.reference.root, chaos.victim.root
    victim_checkpoints = chaos.victim.checkpoints
    t0 = time.monotonic()
    if reference_dir is None:
        log = chaos_dir / "reference.log"
        run_to_completion(argv(reference, "reference"), log, env, timeout_s, "reference run")
        processes["reference"] = cache.read_stats(stats_dir / "reference.json")
    t_ref = time.monotonic() - t0
    walls = [r["wall_s"] for r in read_records(reference) if "loss" in r]
    step_s = max(1e-3, (walls[-1] - walls[0]) / max(1, len(walls) - 1)) if len(walls) > 1 else 0.05

    rng = random.Random(seed)
    observed_startup: list[float] = []  # a victim lifetime's time from spawn to its first step
    victim.mkdir(parents=True)
    kill_log: list[dict] = []
    t_victim = time.monotonic()
    while True:
        lifetime = len(kill_log)
        log_path = chaos_dir / f"victim-{lifetime}.log"
        n_before = len(read_records(victim))  # this lifetime's records come after these
        saves_before = saves_in_flight(victim_checkpoints)  # leftovers of earlier lifetimes
        # a kill landed after the final save
        finished = (scan(victim_checkpoints).latest or 0) >= steps
        role = f"lifetime-{lifetime}"
        cold = lifetime > 0 and not warm_resume_cache  # every lifetime after a kill is a resume
        fresh = cache.fresh_cache(stats_dir, role) if cold else None
        lifetime_env = {**env, **cache.cache_env(fresh)} if fresh else env
        with Proc(argv(victim, role), log_path, lifetime_env) as proc:
            if lifetime < kills and not finished:
                # Wall-clock moments are drawn within the start-up a victim lifetime was *seen* to
                # take (the reference's, with a cold compile cache or a loaded machine, can exceed
                # a whole warm run).
                plan = _draw_moment(
                    rng, victim, steps, min(observed_startup) if observed_startup else None, step_s
                )
                t_start = time.monotonic()
                if not _wait_for(proc, victim, plan, n_before, t_start, timeout_s):
                    raise TpulabError(
                        f"victim process {lifetime} ended (exit {proc.p.returncode}) before its "
                        f"drawn kill moment ({plan}): {proc.tail(1)} (log: {log_path})"
                    )
                proc.kill(signal.SIGKILL)
                processes[role] = _lifetime_cache(stats_dir / f"{role}.json", fresh, lifetime)
                if "first_step_s" in plan:
                    observed_startup.append(plan.pop("first_step_s"))
                logged = curve(read_records(victim)[n_before:])
                kill_log.append(
                    {
                        **plan,
                        "at_s": round(time.monotonic() - t_start, 3),
                        "in_flight": saves_started_since(saves_before, victim_checkpoints),
                        "leftovers": sorted(saves_before),
                        "last_logged_step": max(logged) if logged else None,
                        "compile_cache": processes[role],
                    }
                )  # by this lifetime
                continue
            late = f"the final victim process did not finish within {timeout_s:.0f}s"
            rc = proc.wait(timeout_s, late)
            if rc != ExitCode.OK:
                raise TpulabError(
                    f"victim process {lifetime} exited with {rc}: {proc.tail(1)} (log: {log_path})"
                )
            processes[role] = _lifetime_cache(stats_dir / f"{role}.json", fresh, lifetime)
            break
    t_victim = time.monotonic() - t_victim

    verdict = judge_segments(reference, victim, steps)
    verdict.update(final_state_verdict(reference, victim))
    verdict["identical"] = verdict["curves_identical"] and verdict["final_state_identical"]
    verdict.update(
        kills=len(kill_log),
        kills_during_save=sum(1 for k in kill_log if k["in_flight"]),
        kill_log=kill_log,
        seed=seed,
        segments=len(kill_log) + 1,
        signal="SIGKILL",
        steps=steps,
        kill_step=None,  # kills at random moments: each is in kill_log
        resumed_from_step=None,  # each lifetime's: resumed_from_steps
        reference_dir=str(reference),
        run_dir=str(victim),
        timings={"reference_s": round(t_ref, 2), "victim_s": round(t_victim, 2)},
        compile_cache={
            "resumed_cache": "warm (one shared cache)"
            if warm_resume_cache
            else "cold (fresh, empty) for every lifetime after a kill",
            "processes": processes,
        },
        summary=_summary(verdict),
    )
    record = typed_verdict("chaos", verdict)
    chaos.write_verdict(record)
    verdict = record.to_dict()  # the flat dict on disk, for the plot and the callers
    plot_segments(reference, victim, verdict, chaos_dir / "segments.png")
    return verdict


def _lifetime_cache(stats: Path, fresh: Path | None, lifetime: int) -> dict:
    """A lifetime's cache counts; its fresh cache dir (if any) is removed once counted."""
    out = cache.read_stats(stats, fresh, cold=fresh is not None if lifetime else None)
    if fresh is not None:
        shutil.rmtree(fresh)
    return out


def _draw_moment(
    rng: random.Random, victim: Path, steps: int, startup_s: float | None, step_s: float
) -> dict:
    """A kill moment: one in five a pure wall-clock delay from process start, within the start-up
    time seen so far (imports, compile, restore), else a random step after the newest committed
    checkpoint plus a random fraction of a step (so a kill can land anywhere in a step, or while a
    background save is in flight). Drawn so the run always has steps left to be killed in."""
    if startup_s is not None and rng.random() < 0.2:
        return {"phase": "wall-clock", "delay_s": round(rng.uniform(0.0, startup_s), 3)}
    lo = (scan(RunDir(victim).checkpoints).latest or 0) + 1
    return {
        "phase": "training",
        "after_step": rng.randint(min(lo, steps - 1), steps - 1),
        "delay_s": round(rng.uniform(0.0, step_s), 4),
    }


def _wait_for(
    proc: Proc, victim: Path, plan: dict, n_before: int, t_start: float, timeout_s: float
) -> bool:
    """Wait until the drawn moment; False if the process ended first."""
    if plan["phase"] == "wall-clock":
        # A start-up can be shorter than any seen before (a warm resume near the end: CI saw a
        # 26 s draw outlived by a whole lifetime). Once this lifetime logs a step it is no longer
        # starting up: the kill lands then, recorded as such, while steps are left.
        while time.monotonic() - t_start < plan["delay_s"]:
            if proc.p.poll() is not None:
                return False
            if any("loss" in r for r in read_records(victim)[n_before:]):
                plan["landed"] = "at this lifetime's first logged step, before the drawn delay"
                return True
            time.sleep(0.002)
        return proc.p.poll() is None
    while True:  # the drawn step logged by *this* lifetime (records appended after it started)
        recs = read_records(victim)[n_before:]
        if "first_step_s" not in plan and any("loss" in r for r in recs):
            plan["first_step_s"] = round(time.monotonic() - t_start, 3)
        if any(r.get("step") == plan["after_step"] and "loss" in r for r in recs):
            break
        if proc.p.poll() is not None or time.monotonic() - t_start > timeout_s:
            return False
        time.sleep(0.002)
    time.sleep(plan["delay_s"])
    return proc.p.poll() is None


def judge_segments(reference: Path, victim: Path, steps: int) -> dict:
    """Every step each process lifetime logged equals the reference; together they cover every
    step. The first differing step is the earliest of any lifetime, with the lifetime named."""
    ref = curve(read_records(reference))
    recs = read_records(victim)
    seg_ids = [s["segment"] for s in starts(recs)]
    worst, first, first_lifetime, covered, compared = 0.0, None, None, set(), 0
    for i, seg in enumerate(seg_ids):
        c = compare_curves(ref, curve(recs, segment=seg))
        compared += c["steps_compared"]
        covered |= set(curve(recs, segment=seg))
        worst = max(worst, c["max_abs_diff"]) if c["steps_compared"] else worst
        step = c["first_differing_step"]
        if step is not None and (first is None or step < first):
            first, first_lifetime = step, i
    missing = [s for s in range(1, steps + 1) if s not in covered or s not in ref]
    return {
        "curves_identical": first is None and not missing and compared > 0,
        "max_abs_diff": worst,
        "first_differing_step": first,
        "first_differing_lifetime": first_lifetime,
        "missing_steps": missing[:10],
        "steps_compared": compared,
        "logged_segments": len(seg_ids),
        "resumed_from_steps": [s.get("resumed_from") for s in starts(recs)[1:]],
    }


def _summary(v: dict) -> str:
    curves = (
        f"{v['steps_compared']} logged steps across {v['logged_segments']} logged lifetimes equal "
        "the reference bitwise"
        if v["curves_identical"]
        else f"losses differ (first at step {v['first_differing_step']}, in lifetime "
        f"{v['first_differing_lifetime']}; max |diff| {v['max_abs_diff']:.3g}, missing steps "
        f"{v['missing_steps']})"
    )
    state = (
        "final state bitwise identical"
        if v["final_state_identical"]
        else f"final state differs at {v['first_differing_leaf']}"
    )
    return f"{curves}; {state} ({v['final_state_compared']})"


def plot_segments(reference: Path, victim: Path, verdict: dict, path: Path) -> None:
    import matplotlib  # its colour maps; the figure's preamble is report_kit's

    ref = curve(read_records(reference))
    recs = read_records(victim)
    with figure(
        path, nrows=2, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    ) as (_, (ax, ax_d)):
        rs = sorted(ref)
        ax.plot(
            rs,
            [ref[s] for s in rs],
            color="0.6",
            lw=5,
            alpha=0.6,
            label="reference (uninterrupted)",
        )
        cmap = matplotlib.colormaps["tab10"]
        diffs: dict[int, float] = {}
        for i, start in enumerate(starts(recs)):
            seg = curve(recs, segment=start["segment"])
            xs = sorted(seg)
            if not xs:
                continue
            origin = start.get("resumed_from")
            ax.plot(
                xs,
                [seg[s] for s in xs],
                color=cmap(i % 10),
                lw=1.2,
                marker=".",
                ms=3,
                label=f"lifetime {i}: "
                + ("from scratch" if origin is None else f"resumed from step {origin}"),
            )
            for s in xs:
                if s in ref:
                    diffs[s] = max(diffs.get(s, 0.0), abs(seg[s] - ref[s]))
        for k in verdict["kill_log"]:
            if k["last_logged_step"] is not None:
                ax.axvline(k["last_logged_step"], color="k", ls=":", lw=0.8)
        ax.set_ylabel("train loss")
        ax.set_title(
            f"chaos: {verdict['kills']} random SIGKILLs ({verdict['kills_during_save']} mid-save); "
            + ("IDENTICAL" if verdict["identical"] else "NOT identical"),
            fontsize=10,
        )
        ax.legend(fontsize=7, ncol=2)
        ds = sorted(diffs)
        all_zero = "every logged step of every lifetime: difference exactly 0"
        diff_panel(ax_d, ds, [diffs[s] for s in ds], all_zero)
        ax_d.set_ylabel("max |lifetime - reference|")
        ax_d.set_xlabel("step (dotted: last step logged before a kill)")
