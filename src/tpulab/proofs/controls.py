"""Negative controls of the resume proofs: a trainer told to drop part of what a checkpoint holds
on resume (``tpulab train --skip-restore rng|data``, passed by ``prove-resume --skip-restore``),
so the verdict can be shown to fail. A wrapper around the run's objective: the loop has no switch.

- ``rng``: the first step after a resume runs with the state's RNG key replaced by the fresh
  init's (on a run started from scratch the two are the same key: nothing changes).
- ``data``: the restored data position is dropped; the iterator starts from the beginning again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain

from tpulab.errors import TpulabError
from tpulab.train.objective import DataSource, Objective
from tpulab.train.step import Bound, Steps

SKIPPABLE = ("rng", "data")  # parts of the state a resume may be told to drop


class _FromTheStart(grain.DatasetIterator):
    """A Grain iterator whose restored position is dropped: ``set_state`` goes back to where the
    iterator was made (the start of the stream)."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self._inner, self._start = inner, inner.get_state()

    def __next__(self):
        return next(self._inner)

    def get_state(self):
        return self._inner.get_state()

    def set_state(self, state) -> None:
        self._inner.set_state(self._start)


@dataclasses.dataclass(frozen=True)
class _FreshKeyOnce:
    """The train step, whose first call gets the fresh init's RNG key in its state."""

    inner: Bound
    fresh_rng: Any
    used: list = dataclasses.field(default_factory=list)

    def __call__(self, state, batch):
        if not self.used:
            self.used.append(True)
            state = state._replace(rng=self.fresh_rng)
        return self.inner(state, batch)

    def __getattr__(self, name):  # lower, _cache_size: the wrapped step's
        return getattr(self.inner, name)


class SkipRestore:
    """``objective`` with ``parts`` of a resumed checkpoint dropped; everything else is its own."""

    def __init__(self, objective: Objective, parts: tuple[str, ...]):
        bad = sorted(set(parts) - set(SKIPPABLE))
        if bad:
            raise TpulabError(
                f"unknown part to skip on restore: {bad[0]} (known: {', '.join(SKIPPABLE)})"
            )
        self._objective, self.parts = objective, tuple(parts)

    def __getattr__(self, name):
        return getattr(self._objective, name)

    def data(self) -> DataSource:
        data = self._objective.data()
        if "data" not in self.parts or data.train is None:
            return data
        train = data.train
        return dataclasses.replace(data, train=lambda i, n: _FromTheStart(train(i, n)))

    def steps(self, mesh) -> Steps:
        steps = self._objective.steps(mesh)
        if "rng" not in self.parts:
            return steps
        return dataclasses.replace(steps, train=_FreshKeyOnce(steps.train, steps.init().rng))
