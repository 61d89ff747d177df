"""SIGTERM as a preemption notice: the loop finishes its step, saves and exits 0.

The CLI creates one ``Preemption`` before anything else and keeps it for the whole process, so a
SIGTERM that arrives during start-up is remembered (the run stops after its first step) and one that
arrives after the last checkpoint was written, during shutdown, cannot turn a finished run into a
death by signal. A library caller that passes none gets one for the duration of ``train()``.
"""

from __future__ import annotations

import signal


class Preemption:
    def __init__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._old)

    def finished(self) -> None:
        """The run is saved and done: ignore SIGTERM until exit.

        SIG_IGN, unlike a Python handler, survives interpreter finalization (which resets Python
        handlers to the default, i.e. death by signal).
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
