"""The runner the capstone and the dossier share: a fresh out dir, named stages run in order, the
status line, the report written even when a stage failed, then the exit code.

A stage that fails with a one-line TpulabError becomes a FAILED section of the report instead of
ending it, and every stage is timed. Independent stages can run two at a time (``together``); the
report keeps the order they were given in.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tpulab.checkpoint.files import check_out
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.report_kit import section, table


def prepare_out(out: str | Path) -> Path:
    """``out``, checked by ``check_out`` (a non-empty one is refused: no earlier evidence is
    lost), then created."""
    out = check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that ended and were waited
    for (a stage's trainers, launchers and their workers; a SIGKILLed child's own helpers, reaped
    by init, are not counted)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Stages:
    def __init__(self, label: str):
        self.label = label
        self.sections: list[str] = []
        self.failures: list[str] = []
        self.timings: dict[str, float] = {}
        self.groups: list[list[str]] = []  # stage names, those run together in one group
        self.group_cpu: list[float] = []  # CPU seconds of each group (see ``cpu_seconds``)
        self.group_wall: list[float] = []  # wall seconds of each group
        self._t0: float | None = None
        self._cpu0 = 0.0

    def run(self, name: str, fn: Callable[[], str]) -> None:
        self.together((name, fn))

    def together(self, *stages: tuple[str, Callable[[], str]], first_here: bool = False) -> None:
        """Run ``stages`` at once, one thread each (for stages that mostly wait on their own
        child processes: the demo uses 1.4 of its 2 cores run one at a time). ``first_here``:
        the first stage runs in the calling thread instead, the others beside it (a stage that
        needs the main thread: a trainer's SIGTERM handler can only be installed there).
        Sections, timings and failures are recorded in the order given, whatever order they end
        in. On Ctrl-C (or any exception reaching this thread) every live child ``Proc`` is killed
        and every thread joined before it propagates."""
        from tpulab.proofs.driver import kill_live

        if self._t0 is None:
            self._t0, self._cpu0 = time.monotonic(), cpu_seconds()
        cpu0, wall0 = cpu_seconds(), time.monotonic()
        results: dict[str, tuple[str | None, BaseException | None, float]] = {}

        def one(name: str, fn: Callable[[], str]) -> None:
            t0 = time.monotonic()
            print(f"[{self.label}] {name} …", flush=True)
            text, err = None, None
            try:
                text = fn()
            except TpulabError as e:  # a report row
                err = e
            except BaseException as e:  # a bug or Ctrl-C: end the siblings' children too
                err = e
                kill_live()
            results[name] = (text, err, round(time.monotonic() - t0, 1))
            print(f"[{self.label}] {name} done in {results[name][2]:.0f} s", flush=True)

        if len(stages) == 1:
            one(*stages[0])
        else:
            # Waits on events, not Thread.join: a join that Ctrl-C interrupts can report the
            # thread ended while it still runs (CPython 3.11), and the children outlive us.
            done = {name: threading.Event() for name, _ in stages}

            def run_then_set(name: str, fn: Callable[[], str]) -> None:
                try:
                    one(name, fn)
                finally:
                    done[name].set()

            started = []
            try:
                for name, fn in stages[1:] if first_here else stages:
                    threading.Thread(target=run_then_set, args=(name, fn), name=name).start()
                    started.append(name)
                if first_here:  # a Ctrl-C here is the stage's: ``one`` kills every live child
                    one(*stages[0])
                for name in started:
                    done[name].wait()
            except BaseException:
                kill_live()
                for name in started:
                    done[name].wait()
                raise
        for name, _ in stages:  # a bug in a stage ends the run as it would one at a time
            err = results[name][1]
            if err is not None and not isinstance(err, TpulabError):
                raise err
        for name, _ in stages:
            text, err, seconds = results[name]
            if err is not None:
                self.failures.append(f"{name}: {err}")
                text = section(name, f"**FAILED**: {err}")
            self.sections.append(text)
            self.timings[name] = seconds
        self.groups.append([name for name, _ in stages])
        self.group_cpu.append(round(cpu_seconds() - cpu0, 1))
        self.group_wall.append(round(time.monotonic() - wall0, 1))

    def status(self, passed: str = "PASS", failed: str = "FAIL") -> str:
        """``Status: **PASS**``, or the failed word and every failure."""
        if not self.failures:
            return f"Status: **{passed}**"
        return f"Status: **{failed}** — " + "; ".join(self.failures)

    def times(self) -> str:
        """Each stage's wall seconds, ``a 9 s with b 7 s`` for stages run together, then the wall
        time since the first stage began (less than the sum when some ran together)."""
        wall = 0.0 if self._t0 is None else time.monotonic() - self._t0
        parts = [" with ".join(f"{k} {self.timings[k]:.0f} s" for k in g) for g in self.groups]
        return f"Stage times: {', '.join(parts)} (wall {wall:.0f} s)"

    def cpu(self) -> str:
        """CPU seconds of each group (stages run together share one figure, their threads being
        one process) and in all, with the share of the host's cores they kept busy: on 2 cores a
        group can end no sooner than its CPU seconds / 2."""
        wall = 0.0 if self._t0 is None else time.monotonic() - self._t0
        total = cpu_seconds() - self._cpu0
        parts = [f"{' + '.join(g)} {c:,.0f} s" for g, c in zip(self.groups, self.group_cpu)]
        busy = f", {100 * total / wall:.0f}% of one core" if wall > 0 else ""
        return f"CPU seconds: {', '.join(parts)} (total {total:,.0f} s{busy})"

    def table(self) -> str:
        """Each group's wall and CPU seconds side by side, and the cores it kept busy (CPU / wall):
        what another host's time can be judged by (the same demo took 2.4x the CPU-s on an older
        AMD EPYC than on an AVX-512 one)."""
        rows = [
            (" + ".join(g), f"{w:,.1f}", f"{c:,.1f}", f"{c / w:.2f}" if w > 0 else "-")
            for g, w, c in zip(self.groups, self.group_wall, self.group_cpu)
        ]
        return table(["stage group", "wall s", "CPU s", "cores busy"], rows)

    def record(self) -> dict:
        """The groups' wall and CPU seconds with the host they ran on, for stages.json."""
        from tpulab.evidence.provenance import cpu_model

        wall = 0.0 if self._t0 is None else time.monotonic() - self._t0
        return {
            "groups": [
                {
                    "stages": [{"name": k, "wall_s": self.timings[k]} for k in g],
                    "wall_s": w,
                    "cpu_s": c,
                }
                for g, w, c in zip(self.groups, self.group_wall, self.group_cpu)
            ],
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu_seconds() - self._cpu0, 1),
            "host": {
                "cpu_model": cpu_model(),
                "cpu_count": os.cpu_count(),
                "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
                "xla_flags": os.environ.get("XLA_FLAGS"),
            },
        }

    def body(self) -> str:
        """Every stage's section, in the order they ran."""
        return "\n\n".join(self.sections)

    def finish(self, write: Callable[[], Path], failed: str, see: str = "see") -> Path:
        """Write the report (``write`` returns its path), failed stages and all; then raise
        ``failed (...); see PATH`` (``ExitCode.FAILED``) if any stage failed."""
        path = write()
        if self.failures:
            raise TpulabError(
                f"{failed} ({'; '.join(self.failures)}); {see} {path}", exit_code=ExitCode.FAILED
            )
        return path
