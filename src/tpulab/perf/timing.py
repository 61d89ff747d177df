"""Synchronized step timing for benchmarks: warm-up excluded, one sync per step, robust summaries.

JAX dispatches asynchronously, so a step's wall time means nothing unless the timer stops after
its outputs exist: ``sync`` is ``jax.block_until_ready`` for JAX and a host read (``loss.item()``)
for eager PyTorch. Steps are timed one by one so the median (not the mean) can be reported: a
2-core host shared with other work has outliers that a mean would fold in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from tpulab.evidence.provenance import BASE_PACKAGES, environment

MIN_TIMED_STEPS = 20


def time_steps(
    step: Callable[[], Any], sync: Callable[[Any], Any], n: int, *, warmup: int = 0
) -> list[float]:
    """Run ``step`` ``warmup + n`` times; return the ``n`` post-warm-up wall times (s), each
    synchronized."""
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


# The vector ISA levels XLA:CPU and PyTorch pick kernels by (``--xla_cpu_max_isa``,
# ``ATEN_CPU_CAPABILITY``): what a host kind is, for a speed number.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")


def host_cpu(cpuinfo: str | None = None) -> dict:
    """The host CPU as /proc/cpuinfo names it (first processor): model name, family, model number
    and which of ``ISA_FLAGS`` it has; ``{}`` where there is no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model_name": fields.get("model name", "unknown"),
        "family": fields.get("cpu family", "unknown"),
        "model": fields.get("model", "unknown"),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def benchmark_environment(extra_packages: tuple[str, ...] = ()) -> dict:
    """Provenance of a benchmark: JAX's own device report, versions, commit, the CPU, cores and
    host load."""
    env = environment(BASE_PACKAGES + tuple(extra_packages))
    env["cpu"] = host_cpu()
    env["cpu_count"] = os.cpu_count()
    env["load_avg_1m_5m_15m"] = [round(x, 2) for x in os.getloadavg()]
    return env


@dataclasses.dataclass
class SyncCount:
    count: int = 0
    depth: int = (
        0  # > 0 inside a counted call: nested calls (block_until_ready of one array) add nothing
    )
    entry_points: tuple[str, ...] = ()


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count the host's blocking waits on the device while the block runs.

    Counted at JAX's Python entry points, whoever calls them: ``jax.block_until_ready``,
    ``jax.device_get``, ``Array.block_until_ready``, ``Array.item`` and ``Array._value``, which
    ``float()``, ``int()``, ``bool()``, ``format()``, ``tolist()`` and ``__array__`` go through. One
    outermost call is one sync. Not seen: NumPy reading a CPU array through the buffer protocol
    (``np.asarray(x)`` on XLA:CPU). ``jax.transfer_guard`` cannot do this count: on XLA:CPU it lets
    every device-to-host read through, ``"disallow"`` included (jax 0.10.2, measured).
    """
    import jax
    from jax._src import array

    counter = SyncCount()

    def counted(fn):
        def wrapper(*args, **kwargs):
            counter.count += counter.depth == 0
            counter.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.depth -= 1

        return wrapper

    cls = array.ArrayImpl
    patches = [(jax, "block_until_ready"), (jax, "device_get")]
    patches += [(cls, name) for name in ("block_until_ready", "item")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in patches]
    value = cls.__dict__["_value"]  # a property
    try:
        for owner, name, fn in saved:
            setattr(owner, name, counted(fn))
        cls._value = property(counted(value.fget))
        counter.entry_points = (*(f"{o.__name__}.{n}" for o, n in patches), "ArrayImpl._value")
        yield counter
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        cls._value = value
