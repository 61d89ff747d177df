"""The trainer's side of MLflow lineage: one MLflow run per run dir, continued across kills and
resumes.

Why a separate process: importing mlflow (about 2 s of CPU, nearly all Python under the GIL) and
opening a sqlite store cost seconds; in a thread of the trainer that time competes with the
training loop for the GIL. Every call the loop makes only appends to an in-memory buffer; a sender
thread hands messages (``tpulab.tracking.protocol``) to a helper process
(``tpulab.tracking.writer``, in the trainer's process group, so a kill of the group ends it too)
that makes the MLflow calls. A store that fails never costs a checkpoint.

Why metrics are sent only up to the newest committed checkpoint: after a kill the run resumes from
that checkpoint and redoes the steps after it, so steps not yet covered by a checkpoint are held
back until one is (or the run ends). MLflow's metric history therefore stays one curve; the writer
backfills and marks redone steps at resume time.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

from tpulab.checkpoint.rundir import RunSummary
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
    now_ms,
    points,
)
from tpulab.tracking.store import cause, default_uri, require_writable, warn_tracking_off
from tpulab.train.hooks import Hooks


class MlflowTracker(Hooks):
    """Logs one run dir to one MLflow run. Failures warn once and switch tracking off; training
    goes on. Every number the loop reports (``on_metrics``, ``on_eval``) becomes a metric."""

    def __init__(
        self,
        run_dir: str | Path,
        uri: str | None = None,
        *,
        kind: str = "transformer",
        extra_tags: dict | None = None,
        params: dict | None = None,
        join_timeout_s: float = 120.0,
    ):
        self.run_dir = Path(run_dir)
        self.uri = default_uri(self.run_dir, uri)
        self.kind = kind
        self.extra_tags = dict(extra_tags or {})
        self.params = params
        self.join_timeout_s = join_timeout_s
        self.run_id: str | None = None
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._buffer: list[Point] = []
        self._committed = 0  # steps up to here may be sent
        self._jobs: queue.Queue[Message | None] = queue.Queue()
        self._worker: threading.Thread | None = None  # the sender thread
        self._child: subprocess.Popen | None = None
        self._ended = False
        self._enabled = True

    def check(self) -> None:
        """For --require-tracking: open the store and write to it now; TpulabError if that fails."""
        require_writable(self.uri)

    # ---- the helper process -------------------------------------------------------------------
    def _switch_off(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = cause(e)
            warn_tracking_off(self.uri, self.failed)
        self._enabled = False

    def _pump(self) -> None:
        """Sender thread: messages become lines on the helper's stdin until None."""
        while True:
            message = self._jobs.get()
            if message is None:
                break
            if not self._enabled:
                continue
            try:
                self._child.stdin.write(encode(message))
                self._child.stdin.flush()
            except (OSError, ValueError) as e:  # the helper died: BrokenPipeError
                self._switch_off(e)

    def _submit(self, message: Message) -> None:
        if self._enabled and self._worker is not None:
            self._jobs.put(message)

    def begin(
        self,
        *,
        params: dict,
        env: dict | None = None,
        resumed_from: int | None = None,
        digest: str | None = None,
    ) -> None:
        """Start the helper: it opens the store, finds or creates the run, logs tags, params and
        the resume record."""
        if self._worker is not None or not self._enabled:
            return
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tpulab.tracking.writer"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except OSError as e:
            self._switch_off(e)
            return
        self._jobs.put(Settings(str(self.run_dir), self.uri, self.kind, self.extra_tags))
        self._worker = threading.Thread(target=self._pump, name="mlflow-tracker", daemon=True)
        self._worker.start()
        self._committed = resumed_from or 0
        self._submit(OpenRun(params, env, resumed_from, digest))

    # ---- hooks --------------------------------------------------------------------------------
    def on_start(self, info: dict) -> None:
        env = info.get("env") or {}
        if int(info.get("process_index", env.get("process_index", 0)) or 0) != 0:
            self._enabled = False  # several processes: only process 0 logs
            return
        from tpulab.config import to_dict

        config = info.get("config")
        params = (
            self.params
            if self.params is not None
            else (to_dict(config) if config is not None else {})
        )
        self.begin(
            params=params,
            env=env,
            resumed_from=info.get("resumed_from"),
            digest=info.get("checkpoint_digest"),
        )

    def on_metrics(self, step: int, record: dict) -> None:
        if not self._enabled:
            return
        if self._worker is None and self.params is not None:  # a trainer without on_start (bridge)
            self.begin(params=self.params, resumed_from=step - 1 if step > 1 else None)
        self._add(points(step, record, now_ms()))

    def on_eval(self, step: int, metrics: dict | float) -> None:
        """``metrics``: the evaluation's numbers (``val_loss``, ...); a float is ``val_loss``."""
        if self._enabled:
            values = metrics if isinstance(metrics, dict) else {"val_loss": metrics}
            self._add(points(step, values, now_ms()))

    def _add(self, pts: list[Point]) -> None:
        with self._lock:
            self._buffer.extend(pts)

    def on_checkpoint(self, step: int) -> None:
        """From the loop or the checkpoint thread: everything up to ``step`` may now be sent."""
        if not self._enabled:
            return
        with self._lock:
            self._committed = max(self._committed, step)
            ready = [p for p in self._buffer if p.step <= self._committed]
            self._buffer = [p for p in self._buffer if p.step > self._committed]
        self._submit(Send(ready))

    def flush_all(self) -> None:
        """The run ended normally: nothing will be redone, send everything."""
        with self._lock:
            ready, self._buffer = self._buffer, []
        self._submit(Send(ready))

    def on_end(self, summary: RunSummary) -> None:
        if not self._enabled:
            return
        self.flush_all()
        self._submit(Finish(summary.to_dict()))
        self._finish(None)

    def close(self) -> None:
        """The protocol's last call: after ``on_end`` nothing is left to do; without one the run
        raised, and its MLflow run ends FAILED."""
        self._finish("FAILED")

    def _finish(self, status: str | None) -> None:
        """Drain and wait for the helper (bounded). ``status`` (FAILED) marks a run that ended by
        an error."""
        if self._worker is None or self._ended:
            return
        self._ended = True
        if status is not None and self._enabled:
            with self._lock:
                ready = [p for p in self._buffer if p.step <= self._committed]
                self._buffer = []
            self._submit(Send(ready))
            self._submit(Terminate(status))
        self._jobs.put(None)
        self._worker.join(self.join_timeout_s)
        try:
            out, _ = self._child.communicate(timeout=self.join_timeout_s)  # closes stdin: the end
            lines = out.strip().splitlines()
            outcome = decode(lines[-1]) if lines else None
            if isinstance(outcome, Outcome):
                self.run_id = outcome.run_id or self.run_id
                self.failed = self.failed or outcome.failed
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
            print(
                f"warning: MLflow tracking did not finish within {self.join_timeout_s:.0f} s; "
                "some metrics may be missing from the store",
                file=sys.stderr,
                flush=True,
            )
        except (ValueError, OSError):
            pass
