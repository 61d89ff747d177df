"""Quiet libtpu on hosts without a TPU, without hiding any accelerator.

With ``libtpu`` installed (it is, for ahead-of-time compiles for TPU targets), JAX's first backend
initialization on a host without a TPU makes libtpu print several lines about missing metadata
(accelerator type, worker hostnames) before JAX falls back to the CPU. ``JAX_PLATFORMS=cpu``
would silence the backend part but hides a GPU and would break a real TPU VM; instead, when the
host has no TPU device nodes, the TPU_* variables libtpu would otherwise look up are given
single-host placeholders (only where unset). Measured here: JAX then still reports the CPU, and
topology descriptions for any TPU target (``get_topology_desc``) and their compiles still work.
On a TPU VM (``/dev/accel*`` or ``/dev/vfio``), or where libtpu is not installed (a GPU host), nothing
is touched. The names set are listed in ``TPULAB_PLACEHOLDERS`` (inherited by child processes), so a
receipt can tell them from the environment that really decides the runtime.
"""

from __future__ import annotations

import glob
import importlib.util
import os

MARKER = "TPULAB_PLACEHOLDERS"  # comma-separated names this module set (not the user's, not the runtime's)

_PLACEHOLDERS = {
    "TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata server lookup
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",  # host bounds only; compile targets are named explicitly
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    # Off a TPU nothing runs on a chip, so several processes (a test and the CLI it starts, parallel
    # engineers) may each load libtpu for compiling; without this the second one fails on
    # /tmp/libtpu_lockfile.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def host_has_tpu() -> bool:
    """TPU VMs expose their chips as /dev/accel* (v2-v5e, v6e) or VFIO devices (v5p and later)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_libtpu_off_tpu(environ=os.environ) -> dict[str, str]:
    """Set the placeholders that are unset, off a TPU host; returns what it set (for provenance)."""
    if host_has_tpu() or importlib.util.find_spec("libtpu") is None:
        return {}
    added = {k: v for k, v in _PLACEHOLDERS.items() if k not in environ}
    environ.update(added)
    if added:
        names = [n for n in environ.get(MARKER, "").split(",") if n]
        environ[MARKER] = ",".join(sorted(set(names) | set(added)))
    return added


def placeholders(environ=None) -> set[str]:
    """The names in ``environ`` (default: os.environ) that quiet_libtpu_off_tpu set (here or in a parent)."""
    environ = os.environ if environ is None else environ
    return {n for n in environ.get(MARKER, "").split(",") if n}
