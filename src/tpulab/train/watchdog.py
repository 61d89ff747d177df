"""Stall watchdog: notice when a run stops making progress, leave evidence, optionally exit for a restart.

A job that hangs (a dead collective, a stuck filesystem, a deadlock) burns paid time silently. ``Watchdog``
is the reusable core: a daemon thread that calls ``on_stall`` once when no progress was reported for
``timeout`` seconds. Progress comes from ``beat()`` calls (in-process) or from a ``progress()`` callable it
polls (a supervisor watching another process, e.g. the newest step in a peer's metrics.jsonl: a SIGSTOPped
process stops its own threads too, so only an outside watcher can see it). ``StallWatchdog`` is the training
hook: every logged step, eval and checkpoint is a beat; on a stall it dumps every thread's stack
(faulthandler) into the run dir, appends a ``stall`` event to metrics.jsonl and, if ``exit_code`` is set,
ends the process with that code so a supervisor can restart it from the newest checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from tpulab.evidence import metrics as M
from tpulab.train.hooks import Hooks

STALL_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; distinct from errors (1, 2, 3) and signals (128+n)
MULTIPROCESS_STALL_S = (
    300  # default in a multi-process job, where a stuck peer hangs the others in a collective
)


class Watchdog:
    """Before ``min_beats`` beat intervals were measured (start-up, restore, compile) the timeout is
    ``startup_s``; then ``timeout_s`` when given, else max(``floor_s``, ``factor`` x median recent interval)."""

    def __init__(
        self,
        on_stall: Callable[[dict], None],
        *,
        timeout_s: float | None = None,
        floor_s: float = 120.0,
        factor: float = 20.0,
        startup_s: float = 900.0,
        min_beats: int = 3,
        poll_s: float | None = None,
        progress: Callable[[], object] | None = None,
    ):
        self.on_stall = on_stall
        self.fixed, self.floor_s, self.factor, self.startup_s, self.min_beats = (
            timeout_s,
            floor_s,
            factor,
            startup_s,
            min_beats,
        )
        self.progress = progress
        self._last_marker = progress() if progress else None
        self.poll_s = (
            poll_s if poll_s is not None else max(0.05, min(1.0, (timeout_s or floor_s) / 20))
        )
        self._intervals: deque[float] = deque(maxlen=50)
        self._last = time.monotonic()
        self._last_step: object = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: dict | None = None

    def timeout(self) -> float:
        if len(self._intervals) < self.min_beats:
            return self.startup_s
        if self.fixed is not None:
            return self.fixed
        return max(self.floor_s, self.factor * statistics.median(self._intervals))

    def beat(self, step: object = None) -> None:
        now = time.monotonic()
        if self._last_step is not None:
            self._intervals.append(now - self._last)
        self._last, self._last_step = now, step

    def start(self) -> Watchdog:
        if self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.progress is not None:
                marker = self.progress()
                if marker != self._last_marker:
                    self._last_marker = marker
                    self.beat(marker)
            waited, limit = time.monotonic() - self._last, self.timeout()
            if waited > limit:
                self.fired = {
                    "waited_s": round(waited, 3),
                    "timeout_s": round(limit, 3),
                    "last_step": self._last_step,
                }
                self.on_stall(self.fired)
                return


def metrics_progress(run_dir: str | Path) -> Callable[[], object]:
    """A ``progress`` callable for an outside watcher: (size, mtime) of a run dir's metrics.jsonl."""
    path = Path(run_dir) / M.METRICS

    def marker():
        try:
            st = path.stat()
            return st.st_size, st.st_mtime_ns
        except OSError:
            return None

    return marker


def dump_stacks(path: Path, header: str) -> Path:
    """Every thread's Python stack, as faulthandler writes it (works while the main thread is stuck)."""
    with open(path, "w") as f:
        f.write(header + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path


class StallWatchdog(Hooks):
    """The training hook (see the module docstring). ``exit_code=None`` only records the stall; ``records=False``
    (processes other than 0 of a multi-process job) leaves metrics.jsonl to process 0 and only dumps stacks."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        exit_code: int | None = None,
        records: bool = True,
        **watchdog_args,
    ):
        self.run_dir = Path(run_dir)
        self.exit_code = exit_code
        self.records = records
        self.dog = Watchdog(self._stalled, **watchdog_args)
        self.stalls: list[dict] = []

    def on_start(self, info: dict) -> None:
        self.dog.beat(info.get("start_step"))
        self.dog.start()

    def on_metrics(self, step, record):
        self.dog.beat(step)

    def on_eval(self, step, metrics):
        self.dog.beat(step)

    def on_checkpoint(self, step):
        self.dog.beat(step)

    def on_end(self, summary):
        self.dog.stop()

    def close(self) -> None:
        """Stop watching (the caller's ``finally``: a run that raised gets no on_end)."""
        self.dog.stop()

    def _stalled(self, info: dict) -> None:
        records = M.read_records(self.run_dir)
        segment = M.starts(records)[-1]["segment"] if M.starts(records) else None
        n = sum(1 for r in records if r.get("event") == "stall")
        path = dump_stacks(
            self.run_dir
            / (f"stall-{n}.txt" if self.records else f"stall-{n}-pid{os.getpid()}.txt"),
            f"tpulab stall watchdog: no step completed for {info['waited_s']:.1f} s "
            f"(timeout {info['timeout_s']:.1f} s) after step {info['last_step']}; pid {os.getpid()}",
        )
        event = {
            "event": "stall",
            "segment": segment,
            "pid": os.getpid(),
            "last_step": info["last_step"],
            "waited_s": info["waited_s"],
            "timeout_s": info["timeout_s"],
            "stacks": path.name,
            "exit_code": self.exit_code,
        }
        if self.records:
            with open(
                self.run_dir / M.METRICS, "a"
            ) as f:  # one short O_APPEND line: safe beside the loop's writer
                f.write(json.dumps(event) + "\n")
        self.stalls.append(event)
        print(
            f"error: stalled: no step completed for {info['waited_s']:.0f} s after step {info['last_step']}; "
            f"stacks in {path}"
            + (f"; exiting with {self.exit_code}" if self.exit_code is not None else ""),
            file=sys.stderr,
            flush=True,
        )
        if self.exit_code is not None:
            os._exit(self.exit_code)  # the main thread is stuck: no cleanup can run through it
