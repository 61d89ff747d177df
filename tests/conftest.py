"""Shared fixtures: a tiny-config factory, one compilation cache for every process, one trained run,
and the preference tests' SFT policy and sampled pairs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpulab.libtpu_env import quiet_libtpu_off_tpu, set_explicitly

# libtpu is installed for the AOT tests; off a TPU it must not print on every jax init
quiet_libtpu_off_tpu()

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


@pytest.fixture(scope="session")
def sft_policy(trained_run, tmp_path_factory) -> Path:
    """A tiny SFT run (12 steps from ``trained_run``): the policy and reference of the preference
    tests (tests/test_reward.py, tests/test_dpo.py), read only."""
    from tpulab.train.loop import train

    run_dir = tmp_path_factory.mktemp("sft-policy") / "run"
    sets = ("objective.kind=sft", f"objective.init={trained_run}", "train.steps=12")
    train(
        tiny_config(*sets, "train.eval_every=6", "checkpoint.save_every=6"), run_dir, progress=False
    )
    return run_dir


@pytest.fixture(scope="session")
def sampled_pairs(sft_policy, tmp_path_factory) -> Path:
    """``tpulab pairs`` output from ``sft_policy``: 64 training and 16 held-out prompts."""
    from tpulab.posttrain.pairs import PairsConfig, make_pairs

    out = tmp_path_factory.mktemp("pairs") / "pairs"
    make_pairs(sft_policy, out, PairsConfig(train_prompts=64, eval_prompts=16))
    return out
