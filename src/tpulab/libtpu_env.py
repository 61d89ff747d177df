"""Keep libtpu out of the way on hosts without a TPU, without hiding any accelerator.

``libtpu`` is installed on Linux x86_64 (for ahead-of-time compiles for TPU targets), and JAX's
backend discovery loads it as a PJRT plugin on any host. Off a TPU that costs twice:

- libtpu prints several lines about missing metadata (accelerator type, worker hostnames) before
  JAX falls back to the CPU, and a second process loading it fails on ``/tmp/libtpu_lockfile``;
- the loaded plugin registers libtpu's host profiler, which busy-waits on one core for the whole of
  any ``jax.profiler`` session (gdb: ``xprof::cpu::HostPerfProfiler`` spinning on
  ``PermanentEvent::HasBeenNotified``). Measured on a 2-core host: a profiled default train step
  128-137 ms against 82-84 ms unprofiled; GEMM and large elementwise programs 60-70% slower.

So when the host has no TPU device nodes, the TPU_* variables libtpu would look up get single-host
placeholders, and when it also has no GPU device nodes, ``JAX_PLATFORMS=cpu`` keeps JAX from
starting the TPU backend at all (profiled step then 82.7 vs 82.0 ms). All only where unset. Measured
here: JAX reports the same CPU, and topology descriptions for any TPU target (``get_topology_desc``)
and their compiles still work. On a GPU host ``JAX_PLATFORMS`` is left alone (it would hide the GPU;
profiles there read device time); on a TPU VM, or where libtpu is not installed, nothing is touched.
The names set are listed in ``TPULAB_PLACEHOLDERS`` (inherited by child processes), so a receipt can
tell them from the environment that really decides the runtime; a caller that sets one of them on
purpose uses ``set_explicitly``. Nothing is printed: the names are evidence for the receipt
(``tpulab_placeholders`` in receipt.json and its table), not news for a person's terminal, where a
300-character line before every command's output (``--help`` and a one-line error included) read
as a fault.
"""

from __future__ import annotations

import glob
import importlib.util
import os

# comma-separated names this module set (not the user's, not the runtime's)
MARKER = "TPULAB_PLACEHOLDERS"

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


def host_has_gpu() -> bool:
    """NVIDIA (/dev/nvidia0, ...) or AMD ROCm (/dev/kfd) nodes: what JAX_PLATFORMS=cpu hides."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def quiet_libtpu_off_tpu(environ=os.environ) -> dict[str, str]:
    """Set the placeholders that are unset, off a TPU host, and add their names to ``MARKER``;
    returns what it set (for provenance)."""
    if host_has_tpu() or importlib.util.find_spec("libtpu") is None:
        return {}
    wanted = dict(_PLACEHOLDERS) if host_has_gpu() else {**_PLACEHOLDERS, "JAX_PLATFORMS": "cpu"}
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    if added:
        names = [n for n in environ.get(MARKER, "").split(",") if n]
        environ[MARKER] = ",".join(sorted(set(names) | set(added)))
    return added


def placeholders(environ=None) -> set[str]:
    """The names in ``environ`` (default os.environ) set by quiet_libtpu_off_tpu, here or above."""
    environ = os.environ if environ is None else environ
    return {n for n in environ.get(MARKER, "").split(",") if n}


def set_explicitly(environ: dict, values: dict[str, str]) -> dict:
    """``environ`` with ``values`` set on purpose (a launcher pinning a child to the CPU, a test's
    own settings): those names are the runtime's now, no longer tpulab placeholders."""
    out = {**environ, **values}
    names = sorted(placeholders(out) - set(values))
    out.pop(MARKER, None)
    return {**out, MARKER: ",".join(names)} if names else out
