"""JAX's persistent compilation cache and a compile counter.

A fresh process (a resume, a proof's second run) would otherwise pay the cold XLA compile of the
train step again (about 10 s on a 2-core CPU); with the cache it loads the executable in about a
second. The counter listens to JAX's own backend-compile events, so "no recompiles in steady
state" is measured, not assumed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import jax

ENV = "TPULAB_COMPILE_CACHE"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing to a jaxpr, lowering to StableHLO and the XLA compile: together, what a first call pays
# before it computes anything.
COMPILE_PHASE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    _BACKEND_COMPILE_EVENT,
)


def default_dir() -> Path:
    return Path(
        os.environ.get(ENV)
        or os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or Path.home() / ".cache" / "tpulab" / "jax-compile"
    )


def enable(path: str | Path | None = None) -> Path:
    """Point JAX at a persistent cache dir and cache every executable, however quick to compile."""
    cache = Path(path) if path else default_dir()
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache


_CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_writes",
}


class CompileCounter:
    """Counts, while started, JAX's own events: ``executables`` built (JAX's backend-compile event,
    which also times a persistent cache hit), ``cache_hits`` (executables loaded from the cache),
    ``compiles`` (the difference: XLA really compiled), ``cache_writes`` (compiled and written to
    the cache) and ``seconds`` (trace, lowering and compile phases, hits included).
    A cache entry that cannot be read is a warning and a compile, never an error (JAX's own
    ``_cache_read``): it shows here as a compile without a hit. JAX's listeners are process-wide,
    so two counters in one process both count every compile."""

    def __init__(self):
        self.counts = {"executables": 0, "cache_hits": 0, "cache_writes": 0, "seconds": 0.0}
        self._lock = threading.Lock()
        self._listening = False

    def _on_duration(self, event: str, duration: float, **_):
        with self._lock:
            if event == _BACKEND_COMPILE_EVENT:
                self.counts["executables"] += 1
            if event in COMPILE_PHASE_EVENTS:
                self.counts["seconds"] += duration

    def _on_event(self, event: str, **_):
        if event in _CACHE_EVENTS:
            with self._lock:
                self.counts[_CACHE_EVENTS[event]] += 1

    def start(self) -> CompileCounter:
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        return self

    def stop(self) -> None:
        """Stop counting; a counter never started (a service stopped before it ran) is fine."""
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False

    def snapshot(self) -> dict:
        with self._lock:
            c = dict(self.counts)
        return {
            **c,
            "compiles": c["executables"] - c["cache_hits"],
            "seconds": round(c["seconds"], 3),
        }


@contextlib.contextmanager
def count_compiles():
    """Yields a dict whose ``n`` counts XLA backend compiles inside the block (cache hits included)
    and whose ``seconds`` sums the trace, lowering and compile phases."""
    counter = {"n": 0, "seconds": 0.0}

    def listener(event: str, duration: float, **_):
        if event == _BACKEND_COMPILE_EVENT:
            counter["n"] += 1
        if event in COMPILE_PHASE_EVENTS:
            counter["seconds"] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
