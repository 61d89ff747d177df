"""Chaos's count of kills during a save, with real processes and SIGKILL: a save held open is
counted, and an earlier lifetime's cut-short save seen by a lifetime killed during start-up is
not."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from conftest import REPO, TINY
from tpulab.checkpoint.files import MANIFEST
from tpulab.proofs.chaos import saves_in_flight, saves_started_since
from tpulab.proofs.driver import Proc

pytestmark = pytest.mark.slow


def _hooked(run_dir, *extra):
    return [
        sys.executable,
        str(REPO / "tests" / "hooked_train.py"),
        "--config",
        str(TINY),
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def test_a_kill_during_a_held_save_counts_and_its_leftover_does_not(tmp_path):
    run = tmp_path / "victim"
    ckpt = run / "checkpoints"
    # Lifetime 0 holds checkpoint 10's save open (Orbax wrote it, the marker never comes): killed
    # then, it is a real mid-save kill.
    before = saves_in_flight(ckpt)
    with Proc(_hooked(run, "--hold-commit", "10"), tmp_path / "l0.log") as proc:
        deadline = time.monotonic() + 240
        while not (ckpt / "10").is_dir():
            assert proc.p.poll() is None and time.monotonic() < deadline, proc.tail()
            time.sleep(0.02)
        time.sleep(0.5)  # the committer is held: the marker must still be missing
        assert proc.p.poll() is None and not (ckpt / "10" / MANIFEST).exists()
        proc.kill(signal.SIGKILL)
    assert proc.p.returncode == -signal.SIGKILL
    assert saves_started_since(before, ckpt) == ["10"]

    # Lifetime 1 starts with that leftover and is killed during start-up (long before its store
    # opens and moves step 10 aside): the leftover is still there; this lifetime started no save.
    before = saves_in_flight(ckpt)
    assert sorted(before) == ["10"]
    with Proc(_hooked(run), tmp_path / "l1.log") as proc:
        time.sleep(0.3)
        assert proc.p.poll() is None
        proc.kill(signal.SIGKILL)
    assert (ckpt / "10").is_dir() and not (ckpt / "10" / MANIFEST).exists()
    assert sorted(saves_in_flight(ckpt)) == ["10"]  # what the old count took for a mid-save kill
    assert saves_started_since(before, ckpt) == []
