"""The same train step on 4 devices (forced host platform): state replicated, batch split on `data`."""

import json

import pytest

from conftest import TINY, run_cli
from tpulab.evidence.metrics import curve, read_records

pytestmark = pytest.mark.slow


def test_trains_and_resumes_on_four_devices(tmp_path, trained_run):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = tmp_path / "run"
    result = run_cli(
        "train",
        "--run-dir",
        str(run),
        "--config",
        str(TINY),
        "--steps",
        "12",
        "--no-progress",
        "--set",
        "checkpoint.save_every=5",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "env.json").read_text())["device_count"] == 4
    result = run_cli(
        "train",
        "--run-dir",
        str(run),
        "--config",
        str(TINY),
        "--steps",
        "14",
        "--no-progress",
        "--set",
        "checkpoint.save_every=5",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    four = curve(read_records(run))
    one = curve(read_records(trained_run))
    # Same data, same init: the sharded reduction order may differ, the math must not.
    assert sorted(four) == list(range(1, 15))
    assert all(abs(four[s] - one[s]) < 1e-4 * abs(one[s]) for s in range(1, 15))
