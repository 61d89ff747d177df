"""Aggregate scores over seeds as rliable does (Agarwal et al. 2021, ``rliable`` 1.2.0), in numpy.

Scores are a ``[runs, tasks]`` array (one task: ``[runs, 1]``).

- ``iqm``: the interquartile mean of every score, rliable's ``aggregate_iqm``
  (``scipy.stats.trim_mean(scores, 0.25, axis=None)``): the ``int(0.25 n)`` lowest and highest of
  the ``n`` scores dropped, the rest averaged.
- ``stratified_bootstrap``: rliable's ``StratifiedBootstrap`` with ``conf_int(method=
  "percentile")``: each resample draws, for every task, ``runs`` run indices with replacement
  (strata: the tasks), the statistic of each resample, then the ``(1 - size) / 2`` and
  ``(1 + size) / 2`` percentiles of those (numpy's linear interpolation, as ``arch`` uses).
- ``probability_of_improvement``: rliable's: per task the Mann-Whitney U of ``x`` over ``y``
  divided by ``n_x n_y``, i.e. P(X > Y) + P(X = Y) / 2 over all pairs, averaged over tasks; its
  interval resamples ``x`` and ``y`` independently, stratified by task
  (``StratifiedIndependentBootstrap``).

``tests/test_intervals.py`` checks each against scipy (what rliable calls) on known cases.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _runs_by_tasks(scores) -> np.ndarray:
    a = np.asarray(scores, np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.shape[0] < 1 or not np.isfinite(a).all():
        raise ValueError(f"scores must be a finite [runs, tasks] array, got shape {a.shape}")
    return a


def iqm(scores, axis: tuple[int, ...] | None = None) -> np.ndarray | float:
    """Interquartile mean over all scores (``axis=None``), or over ``axis`` (the others kept)."""
    a = np.asarray(scores, np.float64)
    if axis is None:
        a, axis = a.reshape(-1), (0,)
    moved = np.moveaxis(a, axis, tuple(range(-len(axis), 0)))
    flat = np.sort(moved.reshape(*moved.shape[: moved.ndim - len(axis)], -1), axis=-1)
    n = flat.shape[-1]
    cut = int(0.25 * n)
    out = flat[..., cut : n - cut].mean(axis=-1)
    return float(out) if out.ndim == 0 else out


def _resample(a: np.ndarray, reps: int, rng: np.random.Generator) -> np.ndarray:
    """``[reps, runs, tasks]``: each task's runs drawn with replacement, independently."""
    runs, tasks = a.shape
    idx = rng.integers(0, runs, size=(reps, runs, tasks))
    return a[idx, np.arange(tasks)[None, None, :]]


def _percentiles(values: np.ndarray, size: float) -> tuple[float, float]:
    lo, hi = np.percentile(values, [100 * (1 - size) / 2, 100 * (1 + size) / 2])
    return float(lo), float(hi)


def stratified_bootstrap(
    scores,
    statistic: Callable[[np.ndarray], np.ndarray] = lambda r: iqm(r, axis=(1, 2)),
    *,
    reps: int = 50_000,
    size: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """The ``size`` percentile interval of ``statistic`` over ``reps`` stratified resamples.
    ``statistic`` maps ``[reps, runs, tasks]`` to ``[reps]`` (default: the IQM of each)."""
    a = _runs_by_tasks(scores)
    values = statistic(_resample(a, reps, np.random.default_rng(seed)))
    return _percentiles(values, size)


def _poi(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """P(X > Y) + P(X = Y) / 2 per task, averaged: ``x`` ``[..., nx, tasks]``, ``y`` ``[..., ny,
    tasks]`` -> ``[...]``."""
    gt = (x[..., :, None, :] > y[..., None, :, :]).mean(axis=(-3, -2))
    eq = (x[..., :, None, :] == y[..., None, :, :]).mean(axis=(-3, -2))
    return (gt + 0.5 * eq).mean(axis=-1)


def probability_of_improvement(x, y) -> float:
    """P(a run of X scores higher than a run of Y), ties counted half, averaged over tasks."""
    a, b = _runs_by_tasks(x), _runs_by_tasks(y)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"x has {a.shape[1]} tasks, y {b.shape[1]}")
    return float(_poi(a, b))


def probability_of_improvement_interval(
    x, y, *, reps: int = 50_000, size: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Its percentile interval, ``x`` and ``y`` resampled independently (stratified by task)."""
    a, b = _runs_by_tasks(x), _runs_by_tasks(y)
    rng = np.random.default_rng(seed)
    return _percentiles(_poi(_resample(a, reps, rng), _resample(b, reps, rng)), size)
