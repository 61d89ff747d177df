"""How ``tpulab serve`` stops: SIGTERM/SIGINT latched from its first moment, and an exit that no
thread still inside XLA can turn into an abort.

A signal that lands before the server runs (while JAX is imported, the registry read, the service
built: 10 s and more at load 30) ends the process at once with ``stopped before listening``, exit
0 (``StopSignals(at_once=True)``, as the CLI installs it): no thread has started, nothing has been
written, and waiting for the imports to finish took 10-12 s here, past a 4 s drain bound. Without
the latch it died of the signal (exit 143) or printed a KeyboardInterrupt traceback.

Why ``exit_now``: a daemon thread inside an XLA compile or a running batch when the interpreter
finalizes is unwound by ``pthread_exit`` through C++ frames that do not allow it: ``terminate
called after throwing an instance of '' / FATAL: exception not rethrown``, SIGABRT, exit 134
(reproduced: a SIGTERM 8 s and 15 s into a tiny model's warm-up, 2 of 2; a 10-line script whose
daemon thread compiles in a loop, 3 of 3). Nothing interrupts a compile, and waiting for one can
outlast the drain bound (the default model's take 15 s and more here), so once the drain is done,
the trace log closed and stdout flushed, the process leaves with ``os._exit``: there is nothing left
to save, and the interpreter's own exit cost 2.8 s more even with every thread idle (the stop line
0.7 s after SIGTERM, the exit at 3.5 s; load 13).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Records SIGTERM and SIGINT from ``install`` on (in the main thread) and tells ``on_signal``
    when it is set (the server running); before that, with ``at_once``, the process ends there
    (exit 0: nothing runs yet that could be drained). ``restore`` puts back the previous ones."""

    def __init__(self, at_once: bool = False):
        self.received: list[int] = []
        self.on_signal: Callable[[int], None] | None = None
        self.at_once = at_once
        self._previous: dict = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, sig, frame) -> None:
        self.received.append(sig)
        if self.on_signal is not None:
            self.on_signal(sig)
        elif self.at_once:
            print(f"stopped before listening ({self.names()})", flush=True)
            exit_now(0)

    def names(self) -> str:
        return ", ".join(signal.Signals(s).name for s in self.received)


def exit_now(code: int, error: str | None = None) -> NoReturn:
    """Leave the process with ``code`` (and ``error:`` line) without finalizing the interpreter,
    while a thread may still be inside XLA."""
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
