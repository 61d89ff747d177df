"""Callbacks the training loops call, so proofs, tests and trackers add behaviour without switches.

A caller passes ``hooks=[...]`` to ``train()``; each hook subclasses ``Hooks`` and overrides only
the methods it needs. The loop reads no environment variable and knows nothing about who listens:
the kill/resume proof passes ``HoldAfter`` (through the hidden ``--hold-after-step`` flag of its
child trainer), tests pass hooks that withhold a checkpoint's completion marker or poison a step,
trackers and watchdogs listen to the same calls.

Threads (``tests/test_hooks.py`` records them in a real run with async saves):
- the training thread (the one that called ``train()``) calls ``on_start``, ``after_step``,
  ``on_metrics``, ``on_eval``, ``on_end`` and ``close``;
- ``allow_commit`` and ``on_checkpoint`` are called by whichever thread commits a finished save:
  the checkpoint store's commit thread (``tpulab-ckpt-commit``, every 20 ms) or the training thread
  (its per-step commit check, and the wait before the next save and at the end). Both hold the
  store's lock, so these two are never called concurrently with each other, but they may run at
  the same time as the training thread's methods: state they share with those needs a lock
  (``MlflowTracker`` has one).

Cadence: a hook with ``every = n`` gets its per-step methods (``after_step``, ``on_metrics``) on
steps divisible by ``n`` and on the run's last step (``total_steps``), so the final numbers are
never skipped; a preempted run's last step is not known in advance (``on_end`` says where it
stopped). The other methods have their own cadence (evaluations, saves) and ignore ``every``.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from tpulab.errors import TpulabError

if TYPE_CHECKING:
    from tpulab.checkpoint.rundir import RunSummary


class Hooks:
    """No-op base: the protocol. Per step, the loop calls ``after_step`` then ``on_metrics`` (one
    step late: step N's numbers are read once step N+1 was dispatched)."""

    every: int = 1  # per-step methods on steps divisible by this, and on the last step

    def on_start(self, info: dict) -> None:
        """Once, after the state is built or restored (training thread).

        ``info``: run_dir, start_step, total_steps, resumed_from, config, ...
        """

    def after_step(self, step: int, state: Any, metrics: dict) -> tuple[Any, dict]:
        """Right after step ``step`` was dispatched, with its device values; may replace them
        (training thread; cadence ``every``)."""
        return state, metrics

    def on_metrics(self, step: int, record: dict) -> None:
        """After step ``step``'s numbers were read to the host and written to metrics.jsonl
        (training thread; cadence ``every``)."""

    def on_eval(self, step: int, metrics: dict) -> None:
        """After an evaluation pass: name -> mean (``val_loss`` and whatever else the objective
        evaluates) (training thread)."""

    def allow_commit(self, step: int) -> bool:
        """Whether checkpoint ``step`` may get its completion marker once Orbax has written it
        (the committing thread: the store's or the training thread, under the store's lock)."""
        return True

    def on_checkpoint(self, step: int) -> None:
        """After a checkpoint's completion marker was written (it is now 'latest') (the
        committing thread, as ``allow_commit``)."""

    def on_end(self, summary: RunSummary) -> None:
        """Once, when the loop ends normally (finished or preempted): what ``summary.json`` will
        hold (the loop writes the file after this call) (training thread)."""

    def close(self) -> None:
        """Once, last, whether the run ended or raised (after ``on_end`` when it ended; with no
        ``on_end`` when it raised): stop threads, end helper processes (training thread)."""


def check_every(hook: Hooks) -> int:
    """A hook's cadence, or one line naming the hook: a positive integer (bool is not one)."""
    n = hook.every
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TpulabError(f"{type(hook).__name__}.every={n!r} must be a positive integer")
    return n


class HookList(Hooks):
    """Fans every call out to several hooks, in order, each per-step call at its hook's cadence;
    closes each hook once."""

    def __init__(self, hooks: list[Hooks] | tuple[Hooks, ...] = ()):
        for h in hooks:
            if not isinstance(h, Hooks):
                raise TpulabError(
                    f"a hook must subclass tpulab.train.hooks.Hooks, not {type(h).__name__}"
                )
            check_every(h)
        self.hooks = list(hooks)
        self.total: int | None = None  # the run's last step, from on_start
        self._closed = False

    def _due(self, h: Hooks, step: int) -> bool:
        return step % h.every == 0 or step == self.total

    def on_start(self, info):
        self.total = info.get("total_steps")
        for h in self.hooks:
            h.on_start(info)

    def after_step(self, step, state, metrics):
        for h in self.hooks:
            if self._due(h, step):
                state, metrics = h.after_step(step, state, metrics)
        return state, metrics

    def on_metrics(self, step, record):
        for h in self.hooks:
            if self._due(h, step):
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

    def close(self):
        """Every hook's ``close`` once, even when one raises (the first error is raised after the
        rest were closed, unless another error is already on its way out)."""
        if self._closed:
            return
        self._closed = True
        first = None
        for h in self.hooks:
            try:
                h.close()
            except Exception as e:  # noqa: BLE001 - the others still get closed
                first = first or e
        if first is not None and sys.exc_info()[0] is None:
            raise first


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
