"""The MLflow helper process (``python -m tpulab.tracking.writer``): decodes the tracker's messages
(``tpulab.tracking.protocol``) from stdin and makes the MLflow calls.

The first failure prints one warning and switches tracking off (later messages are read and
dropped). At end of input, whether the trainer ended normally or was killed, it prints one
``Outcome`` line and exits: it never finishes a run on its own, only what it was sent.

Two edge cases of a resume are handled here, from metrics.jsonl: steps the killed process committed
but had not sent yet are backfilled; steps MLflow already holds beyond the resume point (a resume
from an older checkpoint) are logged again under ``redone/<key>``, so the redo is marked, never
silently duplicated.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json
from tpulab.checkpoint.rundir import CONFIG, DOCUMENTS, ENV, GOODPUT, SUMMARY, RunDir, RunSummary
from tpulab.errors import ExitCode
from tpulab.evidence.metrics import read_records
from tpulab.tracking.lineage import flatten, lineage_tags
from tpulab.tracking.protocol import (
    Finish,
    Message,
    OpenRun,
    Outcome,
    Point,
    Send,
    Settings,
    Terminate,
    decode,
    encode,
    logged_points,
    now_ms,
)
from tpulab.tracking.store import (
    RUN_FILE,
    cause,
    open_store,
    quiet_mlflow_logging,
    read_run_link,
    warn_tracking_off,
)

# + summary.json, from the summary the loop hands over, and the newest checkpoint's manifest
ARTIFACTS = (CONFIG, ENV, DOCUMENTS)
CURVE = "loss"  # every trainer's record carries it: its history says which steps MLflow holds


class StoreWriter:
    """Executes one tracker's messages against its MLflow store, in the helper process."""

    def __init__(self, settings: Settings):
        self.run_dir = Path(settings.run_dir)
        self.uri = settings.uri
        self.kind = settings.kind
        self.extra_tags = dict(settings.extra_tags)
        self.client = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.failed: str | None = None
        self.logged_max = 0  # highest step MLflow held when this process started

    def handle(self, message: Message) -> None:
        match message:
            case OpenRun():
                self.open_run(message)
            case Send(points=pts):
                self.send(pts)
            case Finish(summary=summary):
                self.finish(RunSummary.from_dict(summary, "the trainer's Finish message"))
            case Terminate(status=status):
                self.terminate(status)
            case _:
                raise ValueError(f"unexpected tracking message {type(message).__name__}")

    def fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = cause(e)
            warn_tracking_off(self.uri, self.failed)

    def open_run(self, m: OpenRun) -> None:
        """Find or create the run, then tags, params and the resume record."""
        from mlflow.entities import Param, RunTag

        if self.client is None:
            self.client, self.experiment_id = open_store(self.uri)
        c = self.client
        stored = read_run_link(self.run_dir)
        run = None
        if stored and stored.get("tracking_uri") == self.uri:
            try:
                run = c.get_run(stored["run_id"])
            except Exception:  # noqa: BLE001 - the store no longer holds it: start a new one
                run = None
        new = run is None
        if new:
            run = c.create_run(
                self.experiment_id, run_name=self.run_dir.name, tags={"tpulab.kind": self.kind}
            )
            atomic_write_json(
                self.run_dir / RUN_FILE,
                {
                    "tracking_uri": self.uri,
                    "run_id": run.info.run_id,
                    "experiment_id": self.experiment_id,
                },
            )
        elif run.info.status != "RUNNING":
            c.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        tags = {
            **lineage_tags(self.run_dir, m.env),
            **{k: str(v) for k, v in self.extra_tags.items()},
        }
        have = {} if new else run.data.params  # a killed first process may have died before them
        items = [Param(k, v[:6000]) for k, v in flatten(m.params).items() if k not in have]
        for i in range(0, len(items), 100):
            c.log_batch(self.run_id, params=items[i : i + 100])
        if m.resumed_from is not None:  # also when an earlier process died before creating the run
            existing = (
                {p.step for p in c.get_metric_history(self.run_id, CURVE)} if not new else set()
            )
            self.logged_max = max(existing, default=0)
            n = int(run.data.tags.get("tpulab.resume_count", "0")) + 1
            tags["tpulab.resume_count"] = str(n)
            tags[f"tpulab.resume.{n}"] = json.dumps(
                {
                    "from_checkpoint_step": m.resumed_from,
                    "checkpoint_manifest_digest": m.digest,
                    "steps_already_logged": self.logged_max,
                    "steps_redone_marked": max(0, self.logged_max - m.resumed_from),
                    "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                }
            )
            self.backfill(m.resumed_from)
        items = [RunTag(k, v[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            c.log_batch(self.run_id, tags=items[i : i + 100])

    def backfill(self, upto: int) -> None:
        """Steps an earlier (killed) process committed but had not sent yet, from metrics.jsonl."""
        if upto <= self.logged_max:
            return
        pts = logged_points(read_records(self.run_dir), after=self.logged_max, upto=upto)
        self.send(pts)
        if pts:
            self.logged_max = max(self.logged_max, upto)

    def send(self, pts: list[Point]) -> None:
        """Batched: at most 1000 metrics per call. Steps MLflow already held go to redone/<key>."""
        from mlflow.entities import Metric

        if not pts or self.run_id is None:
            return
        metrics = [
            Metric(
                ("redone/" + p.key) if p.step <= self.logged_max else p.key,
                p.value,
                p.ts_ms,
                p.step,
            )
            for p in pts
        ]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, summary: RunSummary) -> None:
        from mlflow.entities import Metric, RunTag

        c, rid = self.client, self.run_id
        if rid is None:
            return
        try:
            from tpulab.evidence.goodput import goodput

            g = goodput(self.run_dir)
        except Exception:  # noqa: BLE001 - goodput is a bonus, never a reason to lose the run's end
            g = None
        step = summary.final_step
        now = now_ms()
        metrics = [
            Metric(k, float(v), now, step)
            for k, v in (
                ("final_loss", summary.final_loss),
                ("final_val_loss", summary.final_val_loss),
            )
            if v is not None and math.isfinite(v)
        ]  # NaN: no step ran
        if g is not None and g["total_s"] > 0:  # trainers whose records carry wall_s
            metrics.append(Metric("goodput", g["goodput"], now, step))
        tags = [
            RunTag("tpulab.final_step", str(step)),
            RunTag("tpulab.preempted", str(summary.preempted)),
        ]
        c.log_batch(rid, metrics=metrics, tags=tags)
        manifest = summary.latest_checkpoint
        files = [self.run_dir / n for n in ARTIFACTS]
        if manifest is not None:
            files.append(RunDir(self.run_dir).manifest(manifest))
        for p in files:
            if p.is_file():
                c.log_artifact(rid, str(p))
        c.log_dict(rid, summary.to_dict(), SUMMARY)  # the loop writes its file only after on_end
        if g is not None and g["total_s"] > 0:
            c.log_dict(rid, g, GOODPUT)
        c.set_terminated(rid, "KILLED" if summary.preempted else "FINISHED")

    def terminate(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status)


def main() -> int:
    import os
    import signal

    # A preemption notice or Ctrl-C reaches the whole process group: the trainer handles it and then
    # closes our stdin, so its last steps still get logged. A kill of the trainer closes stdin too.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # MLflow logs a failing store call with a long traceback before raising it; the writer turns the
    # raise into its one warning line, so MLflow's own logging is kept to what cannot be reported.
    os.environ["MLFLOW_LOGGING_LEVEL"] = "CRITICAL"
    first = sys.stdin.readline()
    if not first:
        return ExitCode.OK
    settings = decode(first)
    if not isinstance(settings, Settings):
        raise ValueError(f"the first tracking message must be Settings, not {settings!r}")
    writer = StoreWriter(settings)
    quiet_mlflow_logging()
    for line in sys.stdin:
        if writer.failed is not None:
            continue
        try:
            writer.handle(decode(line))
        except Exception as e:  # noqa: BLE001 - any MLflow or sqlite failure: warn once, train on
            writer.fail(e)
    sys.stdout.write(encode(Outcome(run_id=writer.run_id, failed=writer.failed)))
    sys.stdout.flush()
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
