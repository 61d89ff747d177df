"""Stall watchdog: a real training process with an injected hang is noticed, its stacks dumped, a
`stall` event logged and the process ended with the distinct exit code; the same run without the
hang is left alone. The bounds' policy is checked with an injected clock."""

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, TINY
from tpulab.errors import ExitCode
from tpulab.evidence.metrics import read_records
from tpulab.train.watchdog import Watchdog, metrics_progress


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
            "checkpoint.save_every=2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_same_run_without_hang_is_left_alone(tmp_path):
    """Control: the hung runs below without their hang, the same watchdog hook, in this process
    (the hook's exit on a stall is the hung runs' to show: here a stall would only be recorded)."""
    from conftest import tiny_config
    from tpulab.train.loop import train
    from tpulab.train.watchdog import StallWatchdog

    run = tmp_path / "run"
    dog = StallWatchdog(run, timeout_s=60)
    summary = train(
        tiny_config("train.steps=8", "checkpoint.save_every=2"), run, progress=False, hooks=[dog]
    )
    assert summary.final_step == 8 and dog.stalls == []
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

    # an outside watcher on a metrics file (a SIGSTOPped process cannot watch itself): quiet while
    # it grows
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


class FakeClock:
    """An injected monotonic clock: the policy is checked in microseconds, not minutes."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_start_up_bound_is_its_own_and_the_step_bound_applies_from_the_first_step():
    """Start-up (restore, compile, first step) gets ``startup_s``; once one step completed, the
    fixed timeout applies at once. The old policy kept the 900 s start-up bound until 3 intervals
    were measured, so a stall after step 1 went unnoticed for 15 minutes (the second half)."""
    clock, fired = FakeClock(), []
    dog = Watchdog(fired.append, timeout_s=10, startup_s=60, clock=clock)
    assert dog.timeout() == 60
    clock.now += 59
    assert not dog.check() and not fired
    clock.now += 2  # 61 s into start-up
    assert dog.check() and fired == [
        {"waited_s": 61.0, "timeout_s": 60, "last_step": None, "phase": "start-up"}
    ]

    clock, fired = FakeClock(), []
    dog = Watchdog(fired.append, timeout_s=10, startup_s=900, clock=clock)
    clock.now += 300  # a slow compile: well inside start-up
    assert not dog.check()
    dog.beat(1)  # the first step completed
    assert dog.timeout() == 10
    clock.now += 9.5
    assert not dog.check()
    clock.now += 1  # step 2 is 10.5 s overdue: a stall, not a start-up
    assert dog.check() and fired[0]["phase"] == "running" and fired[0]["last_step"] == 1
    assert fired[0]["timeout_s"] == 10 and dog.check() and len(fired) == 1  # fires once


def test_derived_timeout_leaves_the_start_up_interval_out():
    """Without a fixed timeout: the floor until a step interval was measured, then factor x the
    median of step intervals only; a 100 s compile before step 1 must not become a 2000 s bound."""
    clock, fired = FakeClock(), []
    dog = Watchdog(fired.append, floor_s=5, factor=20, startup_s=900, clock=clock)
    clock.now += 100
    dog.beat(1)
    assert dog.timeout() == 5  # no step interval yet: the floor
    for step in (2, 3, 4):
        clock.now += 1
        dog.beat(step)
    assert dog.timeout() == 20  # 20 x 1 s, not 20 x median(100, 1, 1, 1)
    clock.now += 21
    assert dog.check() and fired[0]["timeout_s"] == 20 and fired[0]["last_step"] == 4


def test_bad_stall_bounds_are_one_line_errors(tmp_path, capfd):
    from conftest import run_main
    from tpulab.errors import TpulabError

    for kw in ({"startup_s": 0}, {"timeout_s": -1.0}):
        with pytest.raises(TpulabError, match="must be positive seconds"):
            Watchdog(lambda _: None, **kw)
    p = run_main(
        capfd,
        "train",
        "--config",
        TINY,
        "--run-dir",
        tmp_path / "r",
        "--no-track",
        "--stall-startup-timeout",
        "0",
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: stall start-up timeout must be positive seconds, got 0"
    ]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_cli_flag_sets_the_start_up_bound(tmp_path):
    from tpulab.cli.main import build_parser
    from tpulab.cli.train_cmds import run_health_hooks
    from tpulab.train.watchdog import STARTUP_S, StallWatchdog

    def dog(*flags):
        args = build_parser().parse_args(["train", "--run-dir", str(tmp_path), *flags])
        (hook,) = [
            h
            for h in run_health_hooks(args, tmp_path, distributed=False)
            if isinstance(h, StallWatchdog)
        ]
        return hook.dog

    assert dog("--stall-startup-timeout", "45", "--stall-timeout", "7").startup_s == 45
    assert dog("--stall-startup-timeout", "45", "--stall-timeout", "7").fixed == 7
    assert dog().startup_s == STARTUP_S == 900 and dog().fixed is None


@pytest.mark.slow
def test_real_stalls_in_the_first_steps_are_caught_dumped_and_exit_within_their_bounds(tmp_path):
    """Real training processes, side by side, each with an injected hang: noticed, every thread's
    stack dumped, a `stall` event logged, the process ended with the distinct exit code. A hang
    before step 1 is logged ends at the start-up bound, a hang after step 2 was logged at the step
    bound (the old policy gave both 900 s: it kept the start-up bound until 3 step intervals were
    measured). The running case also leaves a checkpoint to resume from (that was a third process,
    hung at step 6: 34 s of wall alone on 2 idle cores)."""
    # (hang after dispatching step, phase, last step, --stall-timeout, --stall-startup-timeout).
    # Step 2: step 1's numbers are never read, nothing is logged: start-up, bound 10 s (whether the
    # compile or the hang uses it up), and no checkpoint (step 2's save comes after the hang).
    # Step 4: steps 1 and 2 were read before step 2's save, step 3's numbers are read only after
    # step 4 was dispatched: running, last step 2, bound 6 s (a 200 s start-up bound leaves two
    # tiny compiles on 2 loaded cores room: step 1 came at 69 s with a load average of 16 here, in
    # about 10 s on an idle machine); the committer thread writes step 2's marker meanwhile.
    cases = ((2, "start-up", 0, 6, 10), (4, "running", 2, 6, 200))

    def run(case):
        hang_at, _, _, stall_s, startup_s = case
        return _hooked(
            tmp_path / f"hang{hang_at}",
            *("--hang-at", str(hang_at), "--stall-timeout", str(stall_s)),
            *("--stall-startup-timeout", str(startup_s), "--stall-exit"),
        )

    with ThreadPoolExecutor(len(cases)) as pool:  # the old policy: both time out (300 s) here
        outs = list(pool.map(run, cases))
    for (hang_at, phase, last_step, stall_s, startup_s), out in zip(cases, outs):
        run_dir = tmp_path / f"hang{hang_at}"
        bound = startup_s if phase == "start-up" else stall_s
        assert out.returncode == ExitCode.STALLED, out.stderr[-2000:]
        assert "error: stalled" in out.stderr
        (stall,) = [r for r in read_records(run_dir) if r.get("event") == "stall"]
        assert stall["phase"] == phase and stall["last_step"] == last_step, stall
        assert stall["timeout_s"] == bound and bound < stall["waited_s"] < bound + 10
        assert stall["exit_code"] == ExitCode.STALLED
        assert ("in start-up: " in out.stderr) == (phase == "start-up")
        stacks = (run_dir / stall["stacks"]).read_text()
        # every thread, the watchdog's own included; the hung frame where the hang surely came
        # first (at load 13 the start-up bound ran out in step 1's compile, before the hang at 2)
        assert "Thread" in stacks and "hooked_train.py" in stacks
        assert "stall-watchdog" in stacks or "_watch" in stacks
        assert ("after_step" in stacks) or phase == "start-up"
        # a supervisor can resume from here (step 2 was saved before the hang at 4)
        manifest = run_dir / "checkpoints" / "2" / "tpulab_manifest.json"
        assert manifest.exists() == (phase == "running")
