"""Stall watchdog: a real training process with an injected hang is noticed, its stacks dumped, a `stall`
event logged and the process ended with the distinct exit code; the same run without the hang is left alone."""

import json
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, TINY
from tpulab.evidence.metrics import read_records
from tpulab.train.watchdog import STALL_EXIT_CODE, Watchdog, metrics_progress


def _hooked(run_dir, *extra):
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "hooked_train.py"),
            "--config",
            str(TINY),
            "--run-dir",
            str(run_dir),
            "--set",
            "train.steps=8",
            "--set",
            "checkpoint.save_every=4",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_injected_hang_is_caught_dumped_and_exits(tmp_path):
    run = tmp_path / "run"
    out = _hooked(run, "--hang-at", "6", "--stall-timeout", "6", "--stall-exit")
    assert out.returncode == STALL_EXIT_CODE, out.stderr
    assert "error: stalled" in out.stderr
    stall = [r for r in read_records(run) if r.get("event") == "stall"]
    assert len(stall) == 1 and stall[0]["waited_s"] > 6 and stall[0]["exit_code"] == STALL_EXIT_CODE
    assert stall[0]["last_step"] in (
        4,
        5,
    )  # steps after 5 never completed (the hang is after dispatching 6)
    stacks = (run / stall[0]["stacks"]).read_text()
    assert (
        "Thread" in stacks and "after_step" in stacks and "hooked_train.py" in stacks
    )  # the hung frame
    assert (
        "stall-watchdog" in stacks or "_watch" in stacks
    )  # every thread, the watchdog's own included
    assert (
        run / "checkpoints" / "4" / "tpulab_manifest.json"
    ).exists()  # a supervisor can resume from here


@pytest.mark.slow
def test_same_run_without_hang_is_left_alone(tmp_path):
    run = tmp_path / "run"
    out = _hooked(run, "--stall-timeout", "60", "--stall-exit")
    assert out.returncode == 0, out.stderr
    assert not [r for r in read_records(run) if r.get("event") == "stall"] and not list(
        run.glob("stall-*.txt")
    )


def test_derived_timeout_and_outside_watcher(tmp_path):
    fired = []
    dog = Watchdog(fired.append, floor_s=0.3, factor=5, startup_s=30, poll_s=0.02)
    assert dog.timeout() == 30  # no step measured yet: the start-up allowance
    for s in range(5):
        dog.beat(s)
        time.sleep(0.01)
    assert dog.timeout() == pytest.approx(0.3)  # 5 x ~0.01 s is under the floor
    dog.floor_s = 0.01
    assert 0.04 <= dog.timeout() <= 0.5  # 5 x the median interval

    # an outside watcher on a metrics file (a SIGSTOPped process cannot watch itself): quiet while it grows
    f = tmp_path / "metrics.jsonl"
    f.write_text("")
    dog = Watchdog(
        fired.append, timeout_s=0.4, startup_s=0.4, poll_s=0.02, progress=metrics_progress(tmp_path)
    ).start()
    stop = threading.Event()

    def writer():
        while not stop.wait(0.05):
            with open(f, "a") as fh:
                fh.write(json.dumps({"step": 1}) + "\n")

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(1.0)
    assert not fired  # control: progress keeps it quiet
    stop.set()
    t.join()
    time.sleep(1.0)
    dog.stop()
    assert len(fired) == 1 and fired[0]["timeout_s"] == 0.4 and fired[0]["waited_s"] > 0.4
