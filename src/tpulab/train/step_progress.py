"""How far training is: a tqdm bar on a terminal (``step_bar``) and plain ``[progress]`` lines in
logs (``LogLines``). The bar draws only on a terminal, so a job whose output goes to a file (a
proof child, a cloud VM's log) would otherwise say nothing until it ends; the lines print only off
one. (``tpulab.progress`` is the other kind: one bar or line per item of a short loop of items,
such as export endpoints or cache policies.)"""

from __future__ import annotations

import sys
import time

from tpulab.train.hooks import Hooks


def step_bar(total: int, initial: int, enabled: bool | None):
    """The loop's step bar on stderr (stdout carries the plain lines)."""
    from tqdm import tqdm

    # disable=None: shown on a terminal, silent in logs and subprocesses.
    return tqdm(
        total=total,
        initial=initial,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
    )


class LogLines(Hooks):
    """One line per ``every_s`` seconds (and at the end) with step, loss and rate, when not on a
    terminal."""

    def __init__(self, every_s: float = 10.0, stream=None, force: bool = False):
        self.every_s, self.stream = every_s, stream or sys.stdout
        self.enabled = force or not (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.total = self.start_step = 0
        self._t0 = self._last = time.monotonic()

    def on_start(self, info):
        self.total, self.start_step = info.get("total_steps", 0), info.get("start_step", 0)
        self._t0 = self._last = time.monotonic()
        if self.enabled:
            how = (
                f"resumed from step {self.start_step}"
                if info.get("resumed_from") is not None
                else "from scratch"
            )
            self._print(f"training to step {self.total} ({how})")

    def on_metrics(self, step, record):
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every_s or step == self.total):
            self._last = now
            rate = (step - self.start_step) / max(now - self._t0, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else float("nan")
            self._print(
                f"step {step}/{self.total} loss {record.get('loss', float('nan')):.4f} "
                f"({rate:.2f} step/s, eta {eta:.0f} s)"
            )

    def on_eval(self, step, metrics):
        """``metrics``: the evaluation's means (``val_loss``, ...); a float is ``val_loss``."""
        if not isinstance(metrics, dict):
            metrics = {"val_loss": metrics}
        if self.enabled:
            shown = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())
            self._print(f"step {step}: {shown}")

    def _print(self, text: str) -> None:
        print(f"[progress] {text}", file=self.stream, flush=True)
