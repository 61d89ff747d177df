"""What each process of a proof loaded from JAX's persistent compilation cache, what it compiled.

A resume that reproduces the reference only because it loaded the killed run's executables (on a
GPU, the same autotuning choices) is not the resume a preemption onto a new machine gets: that one
compiles from scratch. So the proofs give every resumed process a cold cache (a fresh, empty dir) by
default, and each child records JAX's own cache events: ``cache_hits`` (an executable loaded),
``cache_misses`` (JAX records it when it writes a freshly compiled executable) and
``compile_requests_use_cache`` (every lookup), and how many executables its cache dir held at its
first lookup. A cold process found none there: whatever it loaded later it had compiled itself (a
program built twice in one process, as torchax's eager ops are, hits its own entry), never another
process's.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json

FLAG = "--cache-stats"  # every trainer the proof driver starts accepts it (hidden from --help)
ENV_VARS = ("TPULAB_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")  # tpulab's and JAX's own
EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
    "/jax/compilation_cache/compile_requests_use_cache": "requests",
}


def record_cache_events(path: str | Path) -> None:
    """In a child, before anything compiles: count JAX's persistent-cache events into ``path``
    (JSON), rewritten after each event, so a SIGKILL loses none. A handful of events per process."""
    import jax

    path = Path(path)
    counts = {"hits": 0, "misses": 0, "requests": 0, "pid": os.getpid()}

    def write() -> None:
        atomic_write_json(path, {**counts, "cache_dir": jax.config.jax_compilation_cache_dir})

    def listener(event: str, **_) -> None:
        if event not in EVENTS:
            return
        if "entries_at_first_lookup" not in counts:  # the first lookup precedes any write
            d = jax.config.jax_compilation_cache_dir
            counts["entries_at_first_lookup"] = cache_entries(d) if d else None
        counts[EVENTS[event]] += 1
        write()

    write()  # zero events is an observation too (a process that never used the cache)
    jax.monitoring.register_event_listener(listener)


def cache_entries(cache_dir: str | Path) -> int:
    """Executables stored in a JAX cache dir (one ``<key>-cache`` file each)."""
    d = Path(cache_dir)
    return sum(1 for p in d.iterdir() if p.name.endswith("-cache")) if d.is_dir() else 0


def read_stats(path: Path, cache_dir: Path | None = None, *, cold: bool | None = None) -> dict:
    """One child's counts as the verdict records them; ``None`` fields when it wrote none."""
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        stats = {"hits": None, "misses": None, "requests": None}
    if cache_dir is not None:
        stats["entries_after"] = cache_entries(cache_dir)
    if cold is not None:
        stats["cold"] = cold
        if cold and stats.get("requests"):  # it looked programs up: in an empty cache dir
            stats["cold_confirmed"] = stats.get("entries_at_first_lookup") == 0
    return stats


def fresh_cache(parent: Path, name: str) -> Path:
    """A new, empty cache dir under ``parent`` (never one a previous attempt left behind)."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))


def cache_env(cache_dir: Path) -> dict[str, str]:
    """Environment that points a child's JAX (and tpulab's default) at ``cache_dir``."""
    return {v: str(cache_dir) for v in ENV_VARS}
