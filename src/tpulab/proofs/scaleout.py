"""Scale-out proofs with real processes: same math on every layout, kill or stall one process of
two, another topology (reshard), no duplicated data. Every job is ``tpulab launch ... -- train ...``
started with the one argv builder (``tpulab_argv``) in a reaped process group.

Tolerances. 1 process x 1 device and any {data, fsdp} layout run the same math, but the sharded step
sums the loss and the gradients in another order (per-device partial sums, then a cross-device
reduce; across processes the reduce runs in gloo). float32 addition is not associative, so the
per-step losses may differ in the last bits (a few ulps at step 2, growing slowly through Adam's
normalisation). The layout table therefore says per pair whether the curves are bitwise equal and
otherwise the largest relative difference, judged against ``LAYOUT_RTOL`` = 1e-4: about 500 times
the measured drift over the tiny run (1.9e-7, docs/scaleout.md), far below the step-to-step loss
change it would have to hide (about 1e-2 relative).
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json
from tpulab.checkpoint.rundir import ReshardVerdict, RunDir, read_json
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import METRICS, curve, read_records
from tpulab.evidence.report_kit import table
from tpulab.proofs.driver import (
    Proc,
    judge,
    plot_overlay,
    plot_proof,
    run_to_completion,
    tpulab_argv,
    typed_verdict,
)
from tpulab.proofs.state import final_state_verdict
from tpulab.proofs.transformer import check_kill_step, default_kill_step, write_child_config
from tpulab.train.config import RunConfig

LAYOUT_RTOL = 1e-4
GRACE_S = 3.0  # launcher teardown grace in the proofs (SIGTERM -> SIGKILL)


def launched(
    log_dir: Path, *command, processes: int, devices: int, options: tuple = ()
) -> list[str]:
    """``tpulab launch`` of ``command`` (a tpulab subcommand and its arguments) on ``processes``
    processes of ``devices`` devices each; ``options``: the launcher's own further flags."""
    return tpulab_argv(
        "launch",
        "--processes",
        processes,
        "--devices-per-process",
        devices,
        *options,
        "--log-dir",
        log_dir,
        "--",
        *command,
    )


def launch_argv(
    config_path: Path,
    run_dir: Path,
    *,
    processes: int,
    devices: int,
    extra: tuple = (),
    grace_s: float = GRACE_S,
) -> list[str]:
    return launched(
        Path(run_dir) / "launch",
        *("train", "--config", config_path, "--run-dir", run_dir, "--no-progress", *extra),
        processes=processes,
        devices=devices,
        options=("--grace", grace_s),
    )


def _no(track: bool) -> tuple[str, ...]:
    """The trainers' extra flags for ``track``: none, or ``--no-track``."""
    return () if track else ("--no-track",)


def _with_mesh(config: RunConfig, data: int, fsdp: int) -> RunConfig:
    import dataclasses

    from tpulab.train.config import MeshConfig

    return dataclasses.replace(config, mesh=MeshConfig(data=data, fsdp=fsdp))


def compare_layout(ref: dict[int, float], other: dict[int, float]) -> dict:
    steps = sorted(set(ref) & set(other))
    rel = [abs(other[s] - ref[s]) / abs(ref[s]) for s in steps]
    bitwise = bool(steps) and all(other[s] == ref[s] for s in steps)
    worst = max(rel) if rel else math.nan
    return {
        "steps": len(steps),
        "bitwise": bitwise,
        "max_rel_diff": worst,
        "first_differing_step": next((s for s in steps if other[s] != ref[s]), None),
        "within_tolerance": bitwise or (bool(steps) and worst <= LAYOUT_RTOL),
    }


LAYOUTS = (
    ("1 proc x 1 dev {data:1, fsdp:1}", 1, 1, 1, 1),
    ("1 proc x 4 dev {data:2, fsdp:2}", 1, 4, 2, 2),
    ("2 proc x 2 dev {data:2, fsdp:2}", 2, 2, 2, 2),
)


def prove_layouts(
    config: RunConfig, out_dir: Path, *, timeout_s: float = 600, track: bool = True
) -> dict:
    """Train the same run on three layouts; table of per-step loss agreement against 1x1 and
    between the two {2,2} layouts (same partitioned program, in-process vs gloo all-reduce).
    ``track=False`` passes ``--no-track`` to every trainer (MLflow costs ~2.2 CPU-s a process)."""
    out_dir = Path(out_dir)
    curves, timings = {}, {}
    for name, procs, devs, data, fsdp in LAYOUTS:
        tag = f"p{procs}d{devs}"
        cfg_path = write_child_config(_with_mesh(config, data, fsdp), out_dir / f"{tag}.yaml")
        t0 = time.monotonic()
        run_to_completion(
            launch_argv(cfg_path, out_dir / tag, processes=procs, devices=devs, extra=_no(track)),
            out_dir / f"{tag}.log",
            dict(os.environ),
            timeout_s,
            f"{name} run",
        )
        timings[name] = round(time.monotonic() - t0, 2)
        curves[name] = curve(read_records(out_dir / tag))
    base, four, two = (n for n, *_ in LAYOUTS)
    rows = [
        {"a": base, "b": four, **compare_layout(curves[base], curves[four])},
        {"a": base, "b": two, **compare_layout(curves[base], curves[two])},
        {"a": four, "b": two, **compare_layout(curves[four], curves[two])},
    ]
    verdict = {
        "rows": rows,
        "rtol": LAYOUT_RTOL,
        "timings_s": timings,
        "steps": config.train.steps,
        "passed": all(r["within_tolerance"] for r in rows),
    }
    atomic_write_json(out_dir / "layouts.json", verdict)
    (out_dir / "layouts.md").write_text(layout_markdown(verdict))
    return verdict


def layout_markdown(v: dict) -> str:
    headers = ["layout A", "layout B", "steps", "bitwise", "max rel diff", "first differing step"]
    rows = [
        (
            r["a"],
            r["b"],
            r["steps"],
            "yes" if r["bitwise"] else "no",
            f"{r['max_rel_diff']:.2e}",
            r["first_differing_step"] or "-",
            f"{'yes' if r['within_tolerance'] else 'NO'} (rtol {v['rtol']:g})",
        )
        for r in v["rows"]
    ]
    return table([*headers, "within rtol"], rows) + "\n"


def _pids(run_dir: Path) -> list[int]:
    path = Path(run_dir) / "launch" / "launch.json"
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise TpulabError(f"{path} did not appear")
        time.sleep(0.05)
    return read_json(path)["pids"]


def interrupt_one(
    argv: list[str],
    run_dir: Path,
    log_path: Path,
    *,
    at_step: int,
    victim: int,
    mode: str,
    timeout_s: float,
    env: dict | None = None,
) -> dict:
    """Start a launched job, wait for step ``at_step`` in process 0's metrics and a committed
    checkpoint, then SIGKILL (``mode='kill'``, the job held there) or SIGSTOP (``mode='stall'``,
    running) process ``victim``; time until the launcher exits. Waiting for the commit matters: a
    save that every process finished can still lack its marker if a process stops before Orbax's
    closing barrier, and is then (rightly) refused."""
    from tpulab.checkpoint.store import scan

    with Proc(argv, log_path, env) as proc:
        pids = _pids(run_dir)
        deadline = time.monotonic() + timeout_s
        while (
            at_step not in curve(read_records(run_dir / METRICS))
            or scan(RunDir(run_dir).checkpoints).latest is None
        ):
            if proc.p.poll() is not None:
                raise TpulabError(
                    f"job exited with {proc.p.returncode} before step {at_step}: {proc.tail(1)}"
                )
            if time.monotonic() > deadline:
                raise TpulabError(
                    f"job did not reach step {at_step} within {timeout_s:.0f}s (log: {log_path})"
                )
            time.sleep(0.02)
        t0 = time.monotonic()

        os.kill(pids[victim], signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        code = proc.wait(
            timeout_s, f"the launcher did not end within {timeout_s:.0f}s of the {mode}"
        )
        took = time.monotonic() - t0
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return {
        "mode": mode,
        "victim_process": victim,
        "signal": "SIGKILL" if mode == "kill" else "SIGSTOP",
        "launcher_exit_code": code,
        "job_end_s": round(took, 3),
        "survivors_after": alive,
        "last_logged_step": max(curve(read_records(run_dir / METRICS))),
    }


def prove_multiprocess_resume(
    config: RunConfig,
    out_dir: Path,
    *,
    processes: int = 2,
    devices: int = 2,
    mode: str = "kill",
    kill_at: int | None = None,
    victim: int = 1,
    stall_timeout_s: float = 10.0,
    reference_dir: Path | None = None,
    timeout_s: float = 600,
    env: dict | None = None,
    track: bool = True,
) -> dict:
    """Reference job; a job whose process ``victim`` is SIGKILLed (held after ``kill_at``) or
    SIGSTOPped (the others then hang in a collective until their step watchdog fires); a fresh
    launch that resumes. Curves and final whole state compared bitwise with the reference;
    verdict.json and overlay.png. ``env`` is added to every job's environment (the capstone's MLflow
    store); ``track=False`` runs every job with ``--no-track``."""
    env = {**os.environ, **(env or {})}
    steps, save_every = config.train.steps, config.checkpoint.save_every
    kill_at = kill_at or default_kill_step(steps, save_every)
    check_kill_step(kill_at, steps, save_every)
    if not 0 <= victim < processes:
        raise TpulabError(f"--victim {victim} must name one of the {processes} processes")
    proof = RunDir(Path(out_dir) / f"proof-{mode}")
    proof_dir = proof.root
    if proof.verdict.exists():
        raise TpulabError(f"{proof_dir} already holds a proof; use a fresh --run-dir")
    cfg_path = write_child_config(config, proof.config)
    watchdog = ("--stall-timeout", str(stall_timeout_s), *_no(track))

    def argv(d, *x):
        return launch_argv(cfg_path, d, processes=processes, devices=devices, extra=(*watchdog, *x))

    timings = {}
    if reference_dir is None:
        reference_dir = proof.reference.root
        t0 = time.monotonic()
        run_to_completion(
            argv(reference_dir),
            proof_dir / "reference.log",
            env,
            timeout_s,
            "reference job",
        )
        timings["reference_s"] = round(time.monotonic() - t0, 2)
    run_dir = proof.interrupted.root
    hold = ("--hold-after-step", str(kill_at)) if mode == "kill" else ()
    t0 = time.monotonic()
    event = interrupt_one(
        argv(run_dir, *hold),
        run_dir,
        proof_dir / "interrupted.log",
        at_step=kill_at,
        victim=victim,
        mode=mode,
        timeout_s=timeout_s,
        env=env,
    )
    timings["interrupted_s"] = round(time.monotonic() - t0, 2)
    expected = ExitCode.PEER_FAILED if mode == "kill" else ExitCode.STALLED
    t0 = time.monotonic()
    run_to_completion(argv(run_dir), proof_dir / "resumed.log", env, timeout_s, "resumed job")
    timings["resumed_s"] = round(time.monotonic() - t0, 2)
    verdict = judge(Path(reference_dir), run_dir, steps=steps, kill_step=event["last_logged_step"])
    verdict.update(final_state_verdict(Path(reference_dir), run_dir))
    teardown = read_json(run_dir / "launch" / "teardown.json", {})
    # the watchdog's one line names the stack file it wrote (tpulab.train.watchdog.StallWatchdog)
    logs = [*(run_dir / "launch").glob("p*.log"), proof_dir / "interrupted.log"]
    said = any(
        "error: stalled: no step completed" in p.read_text(errors="replace")
        for p in logs
        if p.exists()
    )
    stack_dumped = said and any(
        "Thread 0x" in p.read_text(errors="replace")
        or "Current thread" in p.read_text(errors="replace")
        for p in run_dir.glob("stall-*.txt")
    )
    verdict.update(
        event=event,
        teardown=teardown,
        expected_exit_code=expected,
        processes=processes,
        devices_per_process=devices,
        stall_timeout_s=stall_timeout_s,
        grace_s=GRACE_S,
        stack_dumped=stack_dumped if mode == "stall" else None,
        signal=event["signal"],
        timings=timings,
        reference_dir=str(reference_dir),
        run_dir=str(run_dir),
    )
    verdict["identical"] = verdict["curves_identical"] and verdict["final_state_identical"]
    verdict["teardown_ok"] = (
        event["launcher_exit_code"] == expected
        and not event["survivors_after"]
        and (mode == "kill" or stack_dumped)
    )
    record = typed_verdict("scaleout", verdict)
    proof.write_verdict(record)
    verdict = record.to_dict()  # the flat dict on disk, for the plot and the callers
    what = f"{processes}-process job, process {victim} " + (
        "SIGKILLed" if mode == "kill" else f"SIGSTOPped (watchdog {stall_timeout_s:g}s)"
    )
    plot_proof(Path(reference_dir), run_dir, verdict, proof_dir / "overlay.png", title=what)
    return verdict


def prove_reshard(
    config: RunConfig,
    out_dir: Path,
    *,
    at_step: int,
    timeout_s: float = 600,
    reference_dir: Path | None = None,
    track: bool = True,
) -> dict:
    """The 2 processes x 2 devices {2,2} reference's checkpoint ``at_step`` -> resharded onto 1
    process x 2 devices {1,2} -> trained on to the end; its curve over the uninterrupted 2-process
    one (not bitwise: the reduction order changes with the layout; judged against LAYOUT_RTOL).
    ``track=False`` trains with ``--no-track``."""
    out_dir = Path(out_dir)
    two = _with_mesh(config, 2, 2)
    cfg_path = write_child_config(two, out_dir / "p2d2.yaml")

    def run(argv: list[str], log: str, what: str) -> None:
        run_to_completion(argv, out_dir / log, dict(os.environ), timeout_s, what)

    if reference_dir is None:
        reference_dir = RunDir(out_dir).reference.root
        run(
            launch_argv(cfg_path, reference_dir, processes=2, devices=2, extra=_no(track)),
            "reference.log",
            "2-process reference",
        )
    src = Path(reference_dir)  # its checkpoint at ``at_step`` (kept: checkpoint.keep) is the source
    dst = out_dir / "resharded"
    run(
        launched(
            out_dir / "reshard-launch",
            *("reshard", "--run-dir", src, "--out", dst, "--mesh", "data=1,fsdp=2"),
            *("--step", at_step),
            processes=1,
            devices=2,
        ),
        "reshard.log",
        "reshard",
    )
    reshard_result = read_json(dst / "reshard.json")
    run(
        launched(
            dst / "launch",
            *("train", "--config", RunDir(dst).config, "--run-dir", dst, "--no-progress"),
            *("--steps", config.train.steps, *_no(track)),
            processes=1,
            devices=2,
        ),
        "continued.log",
        "continued 1-process run",
    )
    ref = curve(read_records(reference_dir))
    before = {s: v for s, v in ref.items() if s <= at_step}
    after = curve(read_records(dst))
    cmp_after = compare_layout(ref, after)
    record = ReshardVerdict(
        kind="reshard",
        identical=cmp_after["bitwise"],
        kill_step=at_step,
        resumed_from_step=at_step,
        max_abs_diff=max(abs(after[s] - ref[s]) for s in after),
        steps_compared=cmp_after["steps"],
        continued_vs_reference=cmp_after,
        rtol=LAYOUT_RTOL,
        reshard=reshard_result,
        passed=reshard_result["bitwise_equal"]
        and cmp_after["within_tolerance"]
        and sorted(after) == list(range(at_step + 1, config.train.steps + 1)),
    )
    RunDir(out_dir).write_verdict(record)
    verdict = record.to_dict()  # the flat dict on disk, for the plot and the callers
    plot_overlay(
        ref,
        before,
        after,
        verdict,
        out_dir / "overlay.png",
        title=f"2 proc x 2 dev -> resharded at step {at_step} onto 1 proc x 2 dev "
        f"{{data:1, fsdp:2}}; max rel diff {cmp_after['max_rel_diff']:.1e} "
        f"(rtol {LAYOUT_RTOL:g}, not bitwise: another reduction order)",
        labels=(
            "2 proc x 2 dev, uninterrupted",
            f"2 proc x 2 dev, up to its checkpoint at step {at_step}",
            f"1 proc x 2 dev, from the resharded checkpoint {at_step}",
        ),
        marks=("reshard", ""),
    )
    return verdict
