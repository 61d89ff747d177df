"""Synchronized step timing for benchmarks: warm-up excluded, one sync per step, robust summaries.

JAX dispatches asynchronously, so a step's wall time means nothing unless the timer stops after
its outputs exist: ``sync`` is ``jax.block_until_ready`` for JAX and a host read (``loss.item()``)
for eager PyTorch. Steps are timed one by one so the median (not the mean) can be reported: a
2-core host shared with other work has outliers that a mean would fold in.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from tpulab.evidence.provenance import BASE_PACKAGES, environment

MIN_TIMED_STEPS = 20


def time_steps(
    step: Callable[[], Any], sync: Callable[[Any], Any], n: int, *, warmup: int = 0
) -> list[float]:
    """Run ``step`` ``warmup + n`` times; return the ``n`` post-warm-up wall times (s), each synchronized."""
    for _ in range(warmup):
        sync(step())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sync(step())
        times.append(time.perf_counter() - t0)
    return times


def summarize(times: list[float], *, min_steps: int = MIN_TIMED_STEPS) -> dict:
    """Median and spread of per-step times; refuses fewer than ``min_steps`` samples."""
    if len(times) < min_steps:
        raise ValueError(f"{len(times)} timed steps; a median needs at least {min_steps}")
    s = sorted(times)
    q = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {
        "median_s": statistics.median(s),
        "p10_s": q(0.1),
        "p90_s": q(0.9),
        "min_s": s[0],
        "steps": len(s),
    }


def benchmark_environment(extra_packages: tuple[str, ...] = ()) -> dict:
    """Provenance of a benchmark: JAX's own device report, versions, commit, cores and host load."""
    env = environment(BASE_PACKAGES + tuple(extra_packages))
    env["cpu_count"] = os.cpu_count()
    env["load_avg_1m_5m_15m"] = [round(x, 2) for x in os.getloadavg()]
    return env
