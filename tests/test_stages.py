"""The runner the capstone and the dossier share (tpulab.orchestrate.stages), and the capstone's
MLflow store reaching its children in their own environment, never through this process's."""

from __future__ import annotations

import os

import pytest

from conftest import tiny_config
from tpulab.errors import ExitCode, TpulabError
from tpulab.orchestrate.stages import Stages, prepare_out


def sleeping_child(procs: list, log):
    """A stage whose child (``sleep 30``, a ``Proc``) is appended to ``procs`` once it runs."""

    def child() -> str:
        from tpulab.proofs.driver import Proc

        with Proc(["sleep", "30"], log) as proc:
            procs.append(proc)
            proc.p.wait()
        return "## child"

    return child


def test_a_failed_stage_is_reported_written_and_exits_failed(tmp_path):
    stages = Stages("t")
    stages.run("good", lambda: "## good\n\nfine")

    def bad() -> str:
        raise TpulabError("no disk")

    stages.run("bad", bad)
    assert stages.status() == "Status: **FAIL** — bad: no disk"
    assert stages.body() == "## good\n\nfine\n\n## bad\n\n**FAILED**: no disk"
    assert stages.times().startswith("Stage times: good 0 s, bad 0 s")
    path = tmp_path / "report.md"

    def write():
        path.write_text(stages.body())
        return path

    with pytest.raises(TpulabError, match=r"^run failed \(bad: no disk\); see .*report.md") as e:
        stages.finish(write, "run failed")
    assert e.value.exit_code == ExitCode.FAILED and "**FAILED**: no disk" in path.read_text()
    # control: with no failure the same runner passes and returns the path
    ok = Stages("t")
    ok.run("good", lambda: "## good")
    assert ok.status() == "Status: **PASS**" and ok.finish(lambda: path, "x") == path


def test_prepare_out_refuses_a_used_dir(tmp_path):
    assert prepare_out(tmp_path / "new").is_dir()
    (tmp_path / "new" / "keep").write_text("evidence")
    with pytest.raises(TpulabError, match="already exists and is not empty"):
        prepare_out(tmp_path / "new")
    assert (tmp_path / "new" / "keep").read_text() == "evidence"


def test_capstone_gives_its_store_to_children_and_leaves_os_environ_alone(tmp_path, monkeypatch):
    """The training child (stopped at once here, so the rest is skipped) gets the capstone's
    store in the environment it is given; this process's environment is never changed, not
    even while the child runs (the old capstone set and later popped MLFLOW_TRACKING_URI)."""
    from tpulab.orchestrate import capstone
    from tpulab.tracking.store import STORE_NAME, sqlite_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = dict(os.environ)
    seen = []

    def child(argv, log_path, env, timeout_s, what):
        seen.append((what, env.get("MLFLOW_TRACKING_URI"), dict(os.environ)))
        raise TpulabError(f"{what}: stopped by the test")

    monkeypatch.setattr(capstone, "run_to_completion", child)
    out = tmp_path / "cap"
    skip = capstone.CapstoneOptions(
        skip_bridge=True,
        skip_inference=True,
        chaos_kills=0,
        skip_scaleout=True,
        skip_dossier=True,
        skip_posttrain=True,
    )
    with pytest.raises(TpulabError, match="capstone failed") as e:
        capstone.run_capstone(tiny_config(), out, skip)
    assert e.value.exit_code == ExitCode.FAILED
    assert [(w, uri) for w, uri, _ in seen] == [
        ("training run", sqlite_uri(out.absolute() / STORE_NAME))
    ]
    assert seen[0][2] == before, "os.environ changed while the child ran"
    assert dict(os.environ) == before
    report = (out / "report.md").read_text()  # written although a stage failed
    assert "Status: **FAIL**" in report and "training run: stopped by the test" in report


def test_stages_together_run_at_once_and_report_in_the_given_order():
    """Both stages must be inside at the same time (a barrier one-at-a-time running would break);
    the slow one ends last yet keeps its first place, and its failure is recorded as one row."""
    import threading
    import time

    stages = Stages("t")
    both = threading.Barrier(2, timeout=20)

    def slow() -> str:
        both.wait()
        time.sleep(0.3)
        raise TpulabError("slow broke")

    def fast() -> str:
        both.wait()
        return "## fast"

    stages.run("first", lambda: "## first")
    stages.together(("slow", slow), ("fast", fast))
    assert stages.body() == "## first\n\n## slow\n\n**FAILED**: slow broke\n\n## fast"
    assert stages.failures == ["slow: slow broke"]
    assert stages.times().startswith("Stage times: first 0 s, slow 0 s with fast 0 s (wall ")
    # control: a bug (not a TpulabError) is not a report row; it ends the run as before
    with pytest.raises(ZeroDivisionError):
        stages.together(("bug", lambda: str(1 / 0)), ("fine", lambda: "## fine"))


def test_first_here_runs_the_first_stage_in_the_main_thread_beside_the_others():
    """The dossier's trainer installs a SIGTERM handler, which only the main thread may: with
    ``first_here`` the first stage can, while the second runs at the same time (the barrier);
    control: run the plain way, the same stage is in a worker thread and is refused."""
    import signal
    import threading

    both = threading.Barrier(2, timeout=20)

    def handler_stage() -> str:
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))  # ValueError off main
        both.wait()
        return "## main"

    def beside() -> str:
        both.wait()
        return "## beside " + threading.current_thread().name

    stages = Stages("t")
    stages.together(("main", handler_stage), ("beside", beside), first_here=True)
    assert stages.body() == "## main\n\n## beside beside" and not stages.failures
    with pytest.raises(ValueError, match="main thread"):
        Stages("t").together(("main", handler_stage), ("beside", beside))


def test_ctrl_c_in_a_first_here_stage_kills_the_other_stages_children(tmp_path):
    """Ctrl-C lands in the first stage's own code when it runs in the main thread: the child of
    the stage beside it must still be killed within seconds, and the interrupt propagate."""
    import signal
    import threading
    import time

    from tpulab.proofs.driver import Proc

    procs = []
    child = sleeping_child(procs, tmp_path / "sleep.log")

    def main_stage() -> str:
        while not procs:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # interrupted
        return "## main"

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        Stages("t").together(("main", main_stage), ("child", child), first_here=True)
    assert time.monotonic() - t0 < 10, "the child ran on after Ctrl-C"
    assert procs[0].p.returncode == -signal.SIGKILL, "the child was not killed"
    assert not Proc.live and "child" not in {t.name for t in threading.enumerate()}


def test_cpu_seconds_count_a_group_and_its_children_not_its_waits():
    """A group's CPU seconds include its ended children's (a busy child shows); a group that
    only sleeps shows about none (the control)."""
    import subprocess
    import sys
    import time

    def busy_child() -> str:
        loop = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
        subprocess.run([sys.executable, "-c", loop], check=True)
        return "## busy"

    stages = Stages("t")
    stages.run("idle", lambda: time.sleep(0.4) or "## idle")
    stages.together(("busy", busy_child), ("idle too", lambda: time.sleep(0.1) or "## idle"))
    idle, busy = stages.group_cpu
    assert idle < 0.1 and busy >= 0.4, stages.group_cpu
    assert stages.cpu().startswith("CPU seconds: idle 0 s, busy + idle too "), stages.cpu()
    # the table and stages.json's record put each group's wall beside its CPU, with the host
    rows = [r for r in stages.table().splitlines() if r.startswith("| ")][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| idle", "| busy + idle too"], rows
    rec = stages.record()
    (idle_g, busy_g) = rec["groups"]
    assert idle_g["wall_s"] >= 0.4 and idle_g["cpu_s"] < 0.1, idle_g  # the control: waits only
    assert busy_g["cpu_s"] >= 0.4 and [x["name"] for x in busy_g["stages"]] == [
        "busy",
        "idle too",
    ], busy_g
    assert float(rows[1].split(" | ")[2]) >= 0.4 > float(rows[0].split(" | ")[2]), rows
    assert rec["host"]["cpu_model"] and rec["host"]["cpu_count"] >= 1, rec["host"]


def test_ctrl_c_during_stages_together_kills_their_children(tmp_path):
    """Ctrl-C reaches only the main thread and the children sit in their own sessions: the
    runner must kill them itself. A 30 s child must be gone within seconds of the SIGINT."""
    import signal
    import threading
    import time

    from tpulab.proofs.driver import Proc

    procs = []
    child = sleeping_child(procs, tmp_path / "sleep.log")

    def interrupt():
        while not procs:
            time.sleep(0.01)
        time.sleep(0.2)  # the main thread is joining by now
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        Stages("t").together(("child", child), ("idle", lambda: "## idle"))
    assert time.monotonic() - t0 < 10, "the child ran on after Ctrl-C"
    assert procs[0].p.returncode == -signal.SIGKILL, "the child was not killed"
    assert not Proc.live
