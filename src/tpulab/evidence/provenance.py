"""What a run ran on: backend, devices, versions, commit.

Never claims hardware JAX did not report.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

from tpulab.checkpoint.rundir import RunDir, RunEnv
from tpulab.hostmem import allocator
from tpulab.libtpu_env import placeholders

BASE_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


def package_versions(names=BASE_PACKAGES) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The project's commit (with '-dirty' when the tree has changes), or None outside a
    checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def jax_devices() -> dict:
    import jax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_kinds": sorted({d.device_kind for d in devices}),
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows: a CPU-second
    figure means little without it (one stage took 2.4x the CPU-s on an AMD EPYC family 23)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(packages=BASE_PACKAGES, *, with_jax: bool = True) -> dict:
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "packages": package_versions(packages),
        "git_commit": git_commit(),
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host_allocator": allocator(),
        # the libtpu variables tpulab set off a TPU, not the user: the runtime read them too
        "tpulab_placeholders": sorted(placeholders()),
    }
    if with_jax:
        env.update(jax_devices())
        env["is_tpu"] = env["backend"] == "tpu"
    return env


def describe_hardware(env: dict) -> str:
    """One line for reports; says TPU only when JAX reported TPU devices."""
    return hardware_label(
        env.get("backend", "unknown"),
        env.get("device_kind", "unknown"),
        env.get("device_count", "?"),
    )


def hardware_label(backend: str, device_kind: str, device_count: int | str) -> str:
    """``describe_hardware``'s line from its three facts (a typed ``RunEnv``'s attributes)."""
    label = f"{backend.upper()} ({device_kind}) x{device_count}"
    return label if backend == "tpu" else f"{label}, not a TPU"


def write_environment(
    run_dir: str | Path, packages=BASE_PACKAGES, extra: dict | None = None
) -> RunEnv:
    """``env.json``: this process's environment and the loop's ``extra`` facts, checked as the
    typed record before it is written."""
    env = RunEnv.from_dict({**environment(packages), **(extra or {})}, "the run's environment")
    RunDir(run_dir).write_env(env)
    return env
