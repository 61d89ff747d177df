"""Stall watchdog: notice when a run stops making progress, leave evidence, optionally exit.

A job that hangs (a dead collective, a stuck filesystem, a deadlock) burns paid time silently.
``Watchdog`` is the reusable core: a daemon thread that calls ``on_stall`` once when no progress
was reported for ``timeout`` seconds. Progress comes from ``beat()`` calls (in-process) or from a
``progress()`` callable it polls (a supervisor watching another process, e.g. the newest step in a
peer's metrics.jsonl: a SIGSTOPped process stops its own threads too, so only an outside watcher
can see it). ``StallWatchdog`` is the training hook: every logged step, eval and checkpoint is a
beat; on a stall it dumps every thread's stack (faulthandler) into the run dir, appends a
``stall`` event to metrics.jsonl and, if ``exit_code`` is set (``ExitCode.STALLED`` from the CLI),
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

from tpulab.errors import TpulabError
from tpulab.evidence.metrics import METRICS, read_records, starts
from tpulab.train.hooks import Hooks

MULTIPROCESS_STALL_S = (
    300  # default in a multi-process job, where a stuck peer hangs the others in a collective
)
# Start-up bound (restore, compile, first step; --stall-startup-timeout): the default config's
# first step takes about 10 s here, compiles of large models on a TPU take minutes.
STARTUP_S = 900.0


class Watchdog:
    """Until the first beat after ``start()`` (restore, compile, the first step) the timeout is
    ``startup_s``; from the first completed step on it is ``timeout_s`` when given, else
    max(``floor_s``, ``factor`` x the median interval between completed steps), the floor alone
    until one such interval was measured. The start-up interval itself is left out of the median:
    it holds the compile (seconds to minutes), which would inflate a timeout meant for steps.
    ``clock`` (default ``time.monotonic``) is injectable, and ``check()`` is one poll, so the
    policy is testable without waiting for it."""

    def __init__(
        self,
        on_stall: Callable[[dict], None],
        *,
        timeout_s: float | None = None,
        floor_s: float = 120.0,
        factor: float = 20.0,
        startup_s: float = STARTUP_S,
        poll_s: float | None = None,
        progress: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, value in (("stall timeout", timeout_s), ("stall start-up timeout", startup_s)):
            if value is not None and not value > 0:
                raise TpulabError(f"{name} must be positive seconds, got {value:g}")
        self.on_stall = on_stall
        self.fixed, self.floor_s, self.factor, self.startup_s = (
            timeout_s,
            floor_s,
            factor,
            startup_s,
        )
        self.progress = progress
        self.clock = clock
        self._last_marker = progress() if progress else None
        self.poll_s = (
            poll_s if poll_s is not None else max(0.05, min(1.0, (timeout_s or floor_s) / 20))
        )
        self._intervals: deque[float] = deque(maxlen=50)
        self._last = clock()
        self._last_step: object = None
        self._started_up = False  # a beat came after start(): the first step completed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: dict | None = None

    def timeout(self) -> float:
        if not self._started_up:
            return self.startup_s
        if self.fixed is not None:
            return self.fixed
        if not self._intervals:
            return self.floor_s
        return max(self.floor_s, self.factor * statistics.median(self._intervals))

    def beat(self, step: object = None) -> None:
        now = self.clock()
        if self._started_up:
            self._intervals.append(now - self._last)
        self._started_up = True
        self._last, self._last_step = now, step

    def start(self, step: object = None) -> Watchdog:
        """Start watching (start-up phase) from ``step``, the step the run resumes from."""
        if self._thread is None:
            self._last, self._last_step, self._started_up = self.clock(), step, False
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def check(self) -> bool:
        """One poll: read outside progress, fire ``on_stall`` once when overdue; True once fired."""
        if self.fired is not None:
            return True
        if self.progress is not None:
            marker = self.progress()
            if marker != self._last_marker:
                self._last_marker = marker
                self.beat(marker)
        waited, limit = self.clock() - self._last, self.timeout()
        if waited <= limit:
            return False
        self.fired = {
            "waited_s": round(waited, 3),
            "timeout_s": round(limit, 3),
            "last_step": self._last_step,
            "phase": "running" if self._started_up else "start-up",
        }
        self.on_stall(self.fired)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return


def metrics_progress(run_dir: str | Path) -> Callable[[], object]:
    """A ``progress`` callable for an outside watcher: (size, mtime) of RUN_DIR/metrics.jsonl."""
    path = Path(run_dir) / METRICS

    def marker():
        try:
            st = path.stat()
            return st.st_size, st.st_mtime_ns
        except OSError:
            return None

    return marker


def dump_stacks(path: Path, header: str) -> Path:
    """Every thread's Python stack, as faulthandler writes it (works while main hangs)."""
    with open(path, "w") as f:
        f.write(header + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path


class StallWatchdog(Hooks):
    """The training hook (see the module docstring). ``exit_code=None`` only records the stall;
    ``records=False`` (processes other than 0 of a multi-process job) leaves metrics.jsonl to
    process 0 and only dumps stacks."""

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
        self.dog.start(info.get("start_step"))

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
        records = read_records(self.run_dir)
        segment = starts(records)[-1]["segment"] if starts(records) else None
        n = sum(1 for r in records if r.get("event") == "stall")
        path = dump_stacks(
            self.run_dir
            / (f"stall-{n}.txt" if self.records else f"stall-{n}-pid{os.getpid()}.txt"),
            f"tpulab stall watchdog: no step completed for {info['waited_s']:.1f} s (timeout "
            f"{info['timeout_s']:.1f} s, {info['phase']}) after step {info['last_step']}; "
            f"pid {os.getpid()}",
        )
        event = {
            "event": "stall",
            "segment": segment,
            "pid": os.getpid(),
            "last_step": info["last_step"],
            "waited_s": info["waited_s"],
            "timeout_s": info["timeout_s"],
            "phase": info["phase"],
            "stacks": path.name,
            "exit_code": self.exit_code,
        }
        if self.records:
            with open(
                self.run_dir / METRICS, "a"
            ) as f:  # one short O_APPEND line: safe beside the loop's writer
                f.write(json.dumps(event) + "\n")
        self.stalls.append(event)
        print(
            f"error: stalled{' in start-up' if info['phase'] == 'start-up' else ''}: no step "
            f"completed for {info['waited_s']:.0f} s after step {info['last_step']}; "
            f"stacks in {path}"
            + (f"; exiting with {self.exit_code}" if self.exit_code is not None else ""),
            file=sys.stderr,
            flush=True,
        )
        if self.exit_code is not None:
            os._exit(self.exit_code)  # the main thread is stuck: no cleanup can run through it
