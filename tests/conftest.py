"""Shared fixtures: a tiny-config factory, one compilation cache for every process, one trained run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpulab.libtpu_env import quiet_libtpu_off_tpu, set_explicitly

quiet_libtpu_off_tpu()  # libtpu is installed for the AOT tests; off a TPU it must not print on every jax init

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="session", autouse=True)
def compile_cache_env(tmp_path_factory) -> dict:
    """One persistent JAX compilation cache for this process and every child it starts."""
    cache = os.environ.get("TPULAB_COMPILE_CACHE") or str(
        tmp_path_factory.mktemp("jax-compile-cache")
    )
    os.environ["TPULAB_COMPILE_CACHE"] = cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    from tpulab import compile_cache

    compile_cache.enable(cache)
    return {"TPULAB_COMPILE_CACHE": cache, "JAX_COMPILATION_CACHE_DIR": cache}


def tiny_config(*overrides: str):
    """The CI-size RunConfig (configs/tiny.yaml) with ``--set``-style overrides."""
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    return load(RunConfig, TINY, list(overrides))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run dir trained with configs/tiny.yaml for 40 steps (checkpoints at 20, 30, 40)."""
    from tpulab.train.loop import train

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(tiny_config(), run_dir, progress=False)
    return run_dir


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m tpulab.cli ARGS` in a real subprocess (same venv), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tpulab.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=set_explicitly(dict(os.environ), env or {}),
        cwd=cwd or REPO,
    )
