"""``tpulab.evidence.intervals`` against rliable's definitions: rliable 1.2.0 computes the IQM as
``scipy.stats.trim_mean(scores, 0.25, axis=None)``, the probability of improvement from
``scipy.stats.mannwhitneyu(x, y, alternative="greater")``'s U over ``n_x n_y``, and its intervals
with ``arch``'s percentile bootstrap over runs resampled within each task. scipy is what rliable
calls, so the point estimates are checked against it exactly; the interval against the exact
bootstrap distribution, enumerated."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.stats

from tpulab.evidence import intervals


@pytest.mark.parametrize("shape", [(10, 1), (7, 1), (5, 3), (4, 2), (1, 1), (13,)])
def test_iqm_is_rliables_trimmed_mean(shape):
    rng = np.random.default_rng(sum(shape))
    scores = rng.normal(size=shape) * 100
    want = scipy.stats.trim_mean(scores, proportiontocut=0.25, axis=None)
    assert np.isclose(intervals.iqm(scores), want, rtol=0, atol=1e-12)


def test_iqm_on_a_known_case_and_its_control():
    # 10 runs: the 2 lowest and 2 highest dropped; an outlier moves the mean, not the IQM
    scores = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000.0])[:, None]
    assert intervals.iqm(scores) == pytest.approx((3 + 4 + 5 + 6 + 7 + 8) / 6)
    assert scores.mean() == pytest.approx(104.5)  # control: the mean is not robust
    # per-resample IQM over the (runs, tasks) axes, as the bootstrap uses it
    batch = np.stack([scores, scores + 1.0])
    assert np.allclose(intervals.iqm(batch, axis=(1, 2)), [5.5, 6.5])


@pytest.mark.parametrize("seed", range(4))
def test_probability_of_improvement_is_mann_whitney_u(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=(10, 1)).astype(float)  # ties included
    y = rng.integers(0, 6, size=(8, 1)).astype(float)
    u = scipy.stats.mannwhitneyu(x[:, 0], y[:, 0], alternative="greater").statistic
    assert intervals.probability_of_improvement(x, y) == pytest.approx(u / (10 * 8))


def test_probability_of_improvement_known_cases():
    x = np.arange(10.0)
    assert intervals.probability_of_improvement(x, x) == 0.5  # rliable: equal runs -> 0.5
    assert intervals.probability_of_improvement(x + 100, x) == 1.0
    assert intervals.probability_of_improvement(x, x + 100) == 0.0
    # two tasks: averaged over tasks
    xt = np.stack([x + 100, x], axis=1)
    yt = np.stack([x, x + 100], axis=1)
    assert intervals.probability_of_improvement(xt, yt) == 0.5


def _exact_percentiles(scores: np.ndarray, stat, size: float = 0.95) -> tuple[float, float]:
    """The percentile interval of the exact bootstrap distribution: every ordered resample of the
    runs (equally likely), the statistic of each."""
    n = len(scores)
    values = [stat(scores[list(idx)]) for idx in itertools.product(range(n), repeat=n)]
    lo, hi = np.percentile(values, [100 * (1 - size) / 2, 100 * (1 + size) / 2])
    return float(lo), float(hi)


def test_bootstrap_interval_converges_to_the_exact_bootstrap_distribution():
    scores = np.array([0.0, 1.0, 3.0, 9.0, 10.0])  # 5 runs: 3,125 ordered resamples
    lo, hi = intervals.stratified_bootstrap(scores[:, None], lambda r: r.mean(axis=(1, 2)))
    want_lo, want_hi = _exact_percentiles(scores, np.mean)
    assert abs(lo - want_lo) < 0.1 and abs(hi - want_hi) < 0.1, (lo, hi, want_lo, want_hi)
    # the IQM (the default statistic): 5 runs, int(1.25) = 1 cut each side
    lo, hi = intervals.stratified_bootstrap(scores)
    want = _exact_percentiles(scores, lambda r: scipy.stats.trim_mean(r, 0.25))
    assert np.allclose((lo, hi), want, atol=0.1), ((lo, hi), want)
    # control: an interval of the wrong width (80%) does not match
    lo80, hi80 = intervals.stratified_bootstrap(scores, size=0.8)
    assert hi80 < want[1] - 0.5 or lo80 > want[0] + 0.5


def test_bootstrap_is_stratified_by_task():
    """Every resample of a task's runs comes from that task alone (rliable's strata)."""
    a = np.stack([np.arange(6.0), 100 + np.arange(6.0), 1000 + np.arange(6.0)], axis=1)
    r = intervals._resample(a, 500, np.random.default_rng(0))
    assert r.shape == (500, 6, 3)
    for t in range(3):
        assert set(np.unique(r[:, :, t])) <= set(a[:, t])
    # and resamples differ (drawn with replacement, not a permutation of the task's runs)
    assert (np.sort(r[:, :, 0], axis=1) != np.arange(6.0)).any(axis=1).mean() > 0.9


def test_scores_must_be_finite():
    with pytest.raises(ValueError, match="finite"):
        intervals.stratified_bootstrap([1.0, float("nan")])
