"""What every tpulab process does first, before JAX starts its threads or a backend.

The CLI's ``main`` and the benchmark scripts call ``prepare`` and nothing else of this kind.
"""

from __future__ import annotations

from tpulab.hostmem import reuse_freed_memory
from tpulab.libtpu_env import quiet_libtpu_off_tpu


def prepare() -> None:
    """Host allocator reuses XLA:CPU's per-step temporaries (``tpulab.hostmem``); libtpu stays
    quiet and out of the way off a TPU (``tpulab.libtpu_env``)."""
    reuse_freed_memory()
    quiet_libtpu_off_tpu()
