"""Refuse, before anything is built, a model whose training state cannot fit in this host's memory.

Without this, an oversized model aborts the process inside XLA's allocator (``terminate called
... overflow``, exit 134) or pushes the machine into swap. The estimate is
``tpulab.model.config.train_state_bytes`` (parameters, gradients, two Adam moments); it is a lower
bound, so passing the check does not promise the run fits, but failing it proves the run cannot.
The host is the right yardstick even with an accelerator: checkpoints are staged through host
memory. Import-light (no JAX), so the CLI can call it before the heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from tpulab.errors import ConfigError
from tpulab.model.config import family_param_count, train_state_bytes

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig

GiB = 2**30


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Room left under a cgroup v2 memory limit, if this process runs under one."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def available_host_bytes() -> int | None:
    """Memory this process could still get: the smaller of MemAvailable and any cgroup v2 headroom.

    Falls back to ``os.sysconf`` free pages where /proc/meminfo is missing; None if nothing is
    known.
    """
    candidates = [_meminfo_available(), _cgroup_available()]
    if candidates[0] is None:
        try:
            candidates[0] = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def check_fits_host(config: RunConfig, available: int | None = None) -> int:
    """Raise ConfigError if the train state cannot fit in ``available`` bytes (default: the host's).

    Returns the estimate in bytes. Call it at the entry of training, before the run dir is written.
    """
    need = train_state_bytes(config.model, config.precision)
    if available is None:
        available = available_host_bytes()
    if available is not None and need > available:
        raise ConfigError(
            f"the model cannot fit in memory: {family_param_count(config.model):,} parameters "
            f"need at least {need / GiB:,.1f} GiB for parameters, gradients and two Adam "
            f"moments in {config.precision.param_dtype}, and this host has "
            f"{available / GiB:,.1f} GiB available (reduce model.d_model, model.n_layers or "
            "model.mlp_ratio)"
        )
    return need
