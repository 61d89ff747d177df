"""Runs on a worker: the job, and for a preemption rehearsal, a real SIGTERM at a chosen step.

A cloud preemption is a SIGTERM from outside the trainer at a moment it did not choose. The
rehearsal does the same from a parent process on each worker: it watches the job's metrics.jsonl
(local disk, so no ssh round trip delays it) and signals the job once the step is logged. The
trainer finishes its step, saves and exits; the record of what happened goes to ``preempt.json``.

In a multi-process job every worker runs this wrapper on the one shared run dir: each signals its
own process once process 0's metrics show the step (as a slice's maintenance event reaches every
host), the processes agree on the step to stop at, and each wrapper writes its record to its own
worker's disk.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json
from tpulab.checkpoint.rundir import RunDir
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import read_records

PREEMPT_RECORD = "preempt.json"


def _segment_steps(metrics: Path, segment: int) -> int | None:
    steps = [
        r["step"] for r in read_records(metrics) if "step" in r and r.get("segment") == segment
    ]
    return max(steps) if steps else None


def run_with_preemption(
    argv: list[str],
    run_dir: str | Path,
    preempt_at: int,
    poll_s: float = 0.01,
    record: str | Path | None = None,
    settle_s: float = 60.0,
) -> dict:
    """Start ``argv``, SIGTERM it once ``run_dir/metrics.jsonl`` shows step >= preempt_at in its
    segment.

    The record goes to ``record`` (default ``run_dir/preempt.json``). In a multi-process job only
    process 0 writes metrics, into a shared dir whose appends may reach other hosts late (NFS
    attribute caching, gcsfuse uploads on flush): a worker may then see its process stop on the
    notice another worker's process got (the processes agree on the step) before it signalled, and
    a process that exited cleanly waits up to ``settle_s`` for the segment's 'preempted' record (or
    its 'end' without one) to become visible."""
    run_dir = Path(run_dir)
    record = Path(record) if record is not None else run_dir / PREEMPT_RECORD
    metrics = RunDir(run_dir).metrics
    segment = sum(
        1 for r in read_records(metrics) if r.get("event") == "start"
    )  # the job's segment
    proc = subprocess.Popen(argv)
    signalled_at = None
    try:
        while proc.poll() is None:
            step = _segment_steps(metrics, segment)
            if signalled_at is None and step is not None and step >= preempt_at:
                proc.send_signal(signal.SIGTERM)
                signalled_at = step
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:  # interrupted ourselves: do not leave the job behind
            proc.kill()
            proc.wait()
    started = any(
        r.get("event") == "start" and r.get("segment") == segment for r in read_records(metrics)
    )
    deadline = time.monotonic() + (
        settle_s if proc.returncode == ExitCode.OK and (started or signalled_at is not None) else 0
    )
    while True:
        records = read_records(metrics)
        ours = [r for r in records if r.get("segment") == segment]
        preempted = [r["step"] for r in ours if r.get("event") == "preempted"]
        if preempted or any(r.get("event") == "end" for r in ours) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    result = {
        "preempt_at": preempt_at,
        "signal": "SIGTERM",
        "signalled_after_logged_step": signalled_at,
        "job_rc": proc.returncode,
        "segment": segment,
        "preempted_at_step": preempted[0] if preempted else None,
        "last_step": _segment_steps(metrics, segment),
    }
    result["stopped_by"] = (
        None
        if result["preempted_at_step"] is None
        else "this wrapper's SIGTERM"
        if signalled_at is not None
        else "a notice this wrapper did not send (another process's, agreed through the runtime)"
    )
    record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, result)
    if signalled_at is None and result["preempted_at_step"] is None:
        raise TpulabError(
            f"the job ended (exit {proc.returncode}) at step {result['last_step']} before the "
            f"preemption step {preempt_at}; choose a smaller --preempt-at",
            exit_code=ExitCode.FAILED,
        )
    if proc.returncode != ExitCode.OK or result["preempted_at_step"] is None:
        raise TpulabError(
            f"the job did not stop cleanly on SIGTERM (exit {proc.returncode}, no 'preempted' "
            f"record in {metrics})",
            exit_code=ExitCode.FAILED,
        )
    return result
