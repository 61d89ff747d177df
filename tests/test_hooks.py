"""The hook contract as ``tpulab.train.hooks`` states it, read from real runs: which thread calls
each method (async saves, a real disk), ``close()`` once whether the run ends or raises, and the
``every = n`` cadence. Each check has a negative control that shows it can fail."""

from __future__ import annotations

import threading

import pytest

from conftest import tiny_config
from tpulab.errors import TpulabError
from tpulab.train.hooks import HookList, Hooks
from tpulab.train.loop import train

COMMIT_THREAD = "tpulab-ckpt-commit"  # the checkpoint store's committer (checkpoint.store)
TRAINING_ONLY = ("on_start", "after_step", "on_metrics", "on_eval", "on_end", "close")
COMMITTING = ("allow_commit", "on_checkpoint")
STEPS, SAVE_EVERY = 7, 2  # checkpoints at 2, 4, 6 and the last step, 7


class Recorder(Hooks):
    """Records (method, step, thread) for every call. With ``hold_for_commit``, ``after_step`` of
    the step after a save blocks until that save's ``on_checkpoint`` came: the training thread is
    held, so only the store's commit thread can have committed it."""

    def __init__(self, every: int = 1, hold_for_commit: bool = False):
        self.every, self.hold = every, hold_for_commit
        self.calls: list[tuple[str, int | None, threading.Thread]] = []
        self._lock = threading.Lock()  # the commit methods may run beside the training thread's
        self._committed = threading.Condition(self._lock)

    def _record(self, method: str, step: int | None = None) -> None:
        with self._lock:
            self.calls.append((method, step, threading.current_thread()))
            self._committed.notify_all()

    def steps_of(self, method: str) -> list[int]:
        return [s for m, s, _ in self.calls if m == method]

    def on_start(self, info):
        self._record("on_start")

    def after_step(self, step, state, metrics):
        self._record("after_step", step)
        saved = step - 1
        if self.hold and saved > 0 and saved % SAVE_EVERY == 0:
            with self._committed:
                ok = self._committed.wait_for(
                    lambda: saved in [s for m, s, _ in self.calls if m == "on_checkpoint"], 120
                )
            assert ok, f"checkpoint {saved} was not committed while the training thread waited"
        return state, metrics

    def on_metrics(self, step, record):
        self._record("on_metrics", step)

    def on_eval(self, step, metrics):
        self._record("on_eval", step)

    def allow_commit(self, step):
        self._record("allow_commit", step)
        return True

    def on_checkpoint(self, step):
        self._record("on_checkpoint", step)

    def on_end(self, summary):
        self._record("on_end", summary.final_step)

    def close(self):
        self._record("close")


def violations(calls, training: threading.Thread) -> list[str]:
    """Calls that break the documented contract: the training thread's methods on another thread,
    the commit methods on a thread that is neither the training thread nor the store's."""
    bad = []
    for method, step, thread in calls:
        if method in TRAINING_ONLY and thread is not training:
            bad.append(f"{method}({step}) on {thread.name}")
        if method in COMMITTING and not (thread is training or thread.name == COMMIT_THREAD):
            bad.append(f"{method}({step}) on {thread.name}")
    return bad


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One real run (async saves to a real disk) with a holding recorder and an every=3 one."""
    run = tmp_path_factory.mktemp("hooks") / "run"
    cfg = tiny_config(
        f"train.steps={STEPS}",
        f"checkpoint.save_every={SAVE_EVERY}",
        "checkpoint.async_save=true",
    )
    held, every3 = Recorder(hold_for_commit=True), Recorder(every=3)
    summary = train(cfg, run, progress=False, hooks=[held, every3])
    return held, every3, summary, threading.current_thread()


def test_each_method_runs_on_the_thread_the_contract_names(recorded):
    held, _, summary, training = recorded
    assert summary.final_step == STEPS
    assert violations(held.calls, training) == []
    committers = {s: t.name for m, s, t in held.calls if m == "on_checkpoint"}
    assert sorted(committers) == [2, 4, 6, 7]
    # the saves the training thread waited out were committed by the store's thread
    assert all(committers[s] == COMMIT_THREAD for s in (2, 4, 6)), committers
    allowed = {s: t.name for m, s, t in held.calls if m == "allow_commit"}
    assert all(allowed[s] == COMMIT_THREAD for s in (2, 4, 6)), allowed
    # control: the same check flags a training-thread method called from another thread, and a
    # commit method from a thread that is not the store's
    probe = Recorder()
    foreign = threading.Thread(
        target=lambda: (probe.on_metrics(99, {}), probe.on_checkpoint(98)), name="foreign"
    )
    foreign.start()
    foreign.join()
    assert violations(held.calls + probe.calls, training) == [
        "on_metrics(99) on foreign",
        "on_checkpoint(98) on foreign",
    ]
    assert violations(held.calls, threading.Thread(name="not-the-trainer")) != []


def test_close_comes_once_and_last_after_a_normal_end(recorded):
    held, every3, _, _ = recorded
    for r in (held, every3):
        methods = [m for m, _, _ in r.calls if m in ("on_end", "close")]
        assert methods[:2] == ["on_end", "close"] and methods.count("close") == 1, methods
        assert r.calls[-1][0] == "close"


class Boom(Hooks):
    def after_step(self, step, state, metrics):
        if step == 3:
            raise RuntimeError("injected failure at step 3")
        return state, metrics


class BadClose(Hooks):
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1
        raise OSError("cannot close")


def test_close_is_called_once_when_the_run_raises(tmp_path):
    counter, bad = Recorder(), BadClose()
    cfg = tiny_config("train.steps=6", "checkpoint.save_every=2")
    with pytest.raises(RuntimeError, match="injected failure at step 3"):  # not close's OSError
        train(cfg, tmp_path / "run", progress=False, hooks=[counter, Boom(), bad])
    methods = [m for m, _, _ in counter.calls]
    # control: the run really failed mid-run (no step after 3, no on_end), so the close is the
    # failure path's
    assert "on_end" not in methods and max(counter.steps_of("after_step")) == 3
    assert methods.count("close") == 1 and methods[-1] == "close" and bad.closed == 1
    # a run refused before it starts (a mesh larger than the devices) closes its hooks as well
    refused = Recorder()
    with pytest.raises(TpulabError, match="mesh"):
        train(tiny_config("mesh.fsdp=64"), tmp_path / "other", hooks=[refused])
    assert [m for m, _, _ in refused.calls] == ["close"]
    # a close that raises, with no error in flight, is raised, after every hook was closed
    last, bad2 = Recorder(), BadClose()
    hooks = HookList([bad2, last])
    with pytest.raises(OSError, match="cannot close"):
        hooks.close()
    hooks.close()  # a second close closes nothing again
    assert bad2.closed == 1 and [m for m, _, _ in last.calls] == ["close"]


def test_every_n_calls_per_step_methods_on_multiples_and_the_last_step(recorded):
    held, every3, _, _ = recorded
    assert every3.steps_of("after_step") == [3, 6, 7]
    assert every3.steps_of("on_metrics") == [3, 6, 7]
    # control: a hook with the default cadence in the same run saw every step
    assert held.steps_of("after_step") == list(range(1, STEPS + 1))
    assert [s for s in held.steps_of("on_metrics") if s <= STEPS] == list(range(1, STEPS + 1))
    # the other methods ignore the cadence
    assert every3.steps_of("on_checkpoint") == [2, 4, 6, 7] and every3.steps_of("on_eval") == [7]


@pytest.mark.parametrize("every", [0, -2, 1.5, "3", True])
def test_a_bad_cadence_is_one_line_before_anything_is_written(tmp_path, every):
    hook = Recorder()
    hook.every = every
    with pytest.raises(TpulabError, match=r"^Recorder\.every=.* must be a positive integer$"):
        train(tiny_config(), tmp_path / "run", hooks=[hook])
    assert not (tmp_path / "run").exists()


def test_a_hook_must_be_a_hooks(tmp_path):
    class Duck:  # has the methods, not the protocol
        def close(self):
            pass

    with pytest.raises(TpulabError, match="must subclass tpulab.train.hooks.Hooks, not Duck"):
        train(tiny_config(), tmp_path / "run", hooks=[Duck()])
    assert not (tmp_path / "run").exists()
