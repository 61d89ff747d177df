"""One function of a run's config, called again in a fresh process that sees N virtual CPU devices.

An objective's audit compares a number computed here on one device with the same number over
several (a loss or a gradient reduced across devices must not change): ``on_devices(config,
"package.module:function", arrays, n)`` writes the config and the arrays to a temporary directory,
starts ``python -m tpulab.train.virtual_devices`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=n`` (JAX fixes its device count when it starts,
so only a new process can see other devices), and returns what ``function(config, mesh, arrays)``
returned there: a JSON object, computed on a ``data`` mesh over the n devices.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tpulab.checkpoint.rundir import CONFIG, write_config
from tpulab.errors import ExitCode, TpulabError

ARRAYS, RESULT = "arrays.npz", "result.json"
TIMEOUT_S = 300


def on_devices(config, function: str, arrays: dict[str, np.ndarray], devices: int) -> dict:
    """``function(config, mesh, arrays)`` in a child process over ``devices`` virtual CPU devices;
    its dict. A child that fails is one line naming its last error line."""
    with tempfile.TemporaryDirectory(prefix="tpulab-devices-") as tmp:
        write_config(Path(tmp) / CONFIG, config)
        np.savez(Path(tmp) / ARRAYS, **arrays)
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
        )
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        }
        argv = [sys.executable, "-m", __name__, tmp, function, str(devices)]
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TpulabError(
                f"{function} on {devices} virtual devices: no answer in {TIMEOUT_S} s"
            ) from None
        if proc.returncode != ExitCode.OK:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise TpulabError(f"{function} on {devices} virtual devices failed: {last}")
        return json.loads((Path(tmp) / RESULT).read_text())


def _child(tmp: str, function: str, devices: int) -> None:
    import jax

    from tpulab.config import import_named, load
    from tpulab.train.config import MeshConfig, RunConfig
    from tpulab.train.sharding import make_mesh

    if jax.device_count() != devices:
        raise SystemExit(f"asked for {devices} devices, JAX sees {jax.device_count()}")
    config = load(RunConfig, Path(tmp) / CONFIG)
    with np.load(Path(tmp) / ARRAYS) as loaded:
        arrays = {k: loaded[k] for k in loaded.files}
    fn = import_named("virtual devices function", function)
    result = fn(config, make_mesh(MeshConfig()), arrays)
    (Path(tmp) / RESULT).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
