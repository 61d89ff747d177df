"""The proofs' record of compilation-cache hits and misses reads JAX's own events in a real child:
a fresh cache shows misses and no hit (and was empty at the first lookup), the same cache the second
time shows hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tpulab.proofs.cache import cache_entries, cache_env, fresh_cache, read_stats

CHILD = """
import sys
import jax, jax.numpy as jnp
from tpulab.proofs.cache import record_cache_events
from tpulab import compile_cache
record_cache_events(sys.argv[1])
compile_cache.enable()  # the dir from TPULAB_COMPILE_CACHE, as `tpulab train` does
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(4.0)).sum()))
"""


def _child(stats, cache_dir):
    env = {**os.environ, **cache_env(cache_dir)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(stats)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(stats.read_text())


def test_a_fresh_cache_misses_and_the_same_cache_then_hits(tmp_path):
    cache_dir = fresh_cache(tmp_path, "c")
    assert cache_entries(cache_dir) == 0
    cold = _child(tmp_path / "cold.json", cache_dir)
    assert cold["hits"] == 0 and cold["misses"] > 0 and cold["requests"] >= cold["misses"]
    assert cold["entries_at_first_lookup"] == 0
    assert cold["cache_dir"] == str(cache_dir) and cache_entries(cache_dir) == cold["misses"]
    warm = _child(tmp_path / "warm.json", cache_dir)  # the control: the same dir again
    assert warm["hits"] > 0 and warm["misses"] == 0
    assert warm["entries_at_first_lookup"] == cold["misses"]
    assert read_stats(tmp_path / "cold.json", cache_dir, cold=True)["cold_confirmed"] is True
    assert read_stats(tmp_path / "warm.json", cache_dir, cold=True)["cold_confirmed"] is False


def test_a_child_that_wrote_no_stats_reads_as_unknown(tmp_path):
    stats = read_stats(tmp_path / "absent.json", cold=True)
    assert stats["hits"] is None and "cold_confirmed" not in stats
