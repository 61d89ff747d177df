"""Callbacks the training loops call, so proofs, tests and trackers add behaviour without switches.

A caller passes ``hooks=[...]`` to ``train()``; each hook overrides only the methods it needs. The
loop reads no environment variable and knows nothing about who listens: the kill/resume proof passes
``HoldAfter`` (through the hidden ``--hold-after-step`` flag of its child trainer), tests pass hooks
that withhold a checkpoint's completion marker or poison a step, trackers and watchdogs listen to
the same calls.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpulab.checkpoint.rundir import RunSummary


class Hooks:
    """No-op base. Methods are called from the training thread, in this order per step."""

    def on_start(self, info: dict) -> None:
        """Once, after the state is built or restored.

        ``info``: run_dir, start_step, resumed_from, config, ...
        """

    def after_step(self, step: int, state: Any, metrics: dict) -> tuple[Any, dict]:
        """Right after step ``step`` was dispatched, with its device values; may replace them."""
        return state, metrics

    def on_metrics(self, step: int, record: dict) -> None:
        """After step ``step``'s numbers were read to the host and written to metrics.jsonl."""

    def on_eval(self, step: int, metrics: dict) -> None:
        """After an evaluation pass: name -> mean (``val_loss`` and whatever else the objective
        evaluates)."""

    def allow_commit(self, step: int) -> bool:
        """Whether checkpoint ``step`` may get its completion marker once Orbax has written it."""
        return True

    def on_checkpoint(self, step: int) -> None:
        """After a checkpoint's completion marker was written (it is now 'latest')."""

    def on_end(self, summary: RunSummary) -> None:
        """Once, when the loop ends normally (finished or preempted): what ``summary.json`` will
        hold (the loop writes the file after this call)."""


class HookList(Hooks):
    """Fans every call out to several hooks, in order."""

    def __init__(self, hooks: list[Hooks] | tuple[Hooks, ...] = ()):
        self.hooks = list(hooks)

    def on_start(self, info):
        for h in self.hooks:
            h.on_start(info)

    def after_step(self, step, state, metrics):
        for h in self.hooks:
            state, metrics = h.after_step(step, state, metrics)
        return state, metrics

    def on_metrics(self, step, record):
        for h in self.hooks:
            h.on_metrics(step, record)

    def on_eval(self, step, metrics):
        for h in self.hooks:
            h.on_eval(step, metrics)

    def allow_commit(self, step):
        return all(h.allow_commit(step) for h in self.hooks)

    def on_checkpoint(self, step):
        for h in self.hooks:
            h.on_checkpoint(step)

    def on_end(self, summary):
        for h in self.hooks:
            h.on_end(summary)


class HoldAfter(Hooks):
    """Block forever once step ``step`` is logged: the readable kill/resume demo's fixed kill point.

    The process stays alive mid-run, with whatever async work is in flight, until the proof driver
    SIGKILLs it; nothing after the held step is logged or saved.
    """

    def __init__(self, step: int):
        self.step = step

    def on_metrics(self, step, record):
        if step == self.step:
            while True:
                time.sleep(3600)
