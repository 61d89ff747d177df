"""The same train step on 4 devices (forced host platform): state replicated, batch split on
`data`, and a second process that resumes from the first one's checkpoint on the same 4 devices."""

import json

import pytest

from conftest import TINY, run_cli
from tpulab.checkpoint.store import read_meta
from tpulab.evidence.metrics import curve, read_records, starts


def assert_resumed(recs: list[dict], *, from_step: int, new_steps: list[int]) -> None:
    first, *rest = starts(recs)
    assert first.get("resumed_from") is None and len(rest) == 1, starts(recs)
    assert rest[0].get("resumed_from") == from_step, rest[0]
    assert sorted(curve(recs, segment=rest[0]["segment"])) == new_steps


def test_assert_resumed_fails_on_two_runs_from_scratch():
    """Control: two lifetimes that both started from scratch (the second retrained 1..2) fail."""
    recs = [
        {"event": "start", "segment": 0, "resumed_from": None},
        {"step": 1, "segment": 0, "loss": 1.0},
        {"event": "start", "segment": 1, "resumed_from": None},
        *({"step": s, "segment": 1, "loss": 1.0} for s in (1, 2)),
    ]
    with pytest.raises(AssertionError):
        assert_resumed(recs, from_step=1, new_steps=[2])
    recs[2]["resumed_from"], recs[3:4] = 1, []  # the same, resumed from step 1: passes
    assert_resumed(recs, from_step=1, new_steps=[2])


@pytest.mark.slow
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
        "--no-track",  # MLflow is not what this checks (the tracker costs ~5 CPU-s per process)
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
        "--no-track",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    # the second process resumed (it did not train again from scratch): from the final checkpoint
    # of the first, on 4 devices, and logged only the two new steps
    recs = read_records(run)
    assert_resumed(recs, from_step=12, new_steps=[13, 14])
    meta = read_meta(run / "checkpoints" / "14")
    assert meta["topology"]["device_count"] == 4 and meta["step"] == 14
    four = curve(recs)
    one = curve(read_records(trained_run))
    # Same data, same init: the sharded reduction order may differ, the math must not.
    assert sorted(four) == list(range(1, 15))
    assert all(abs(four[s] - one[s]) < 1e-4 * abs(one[s]) for s in range(1, 15))
