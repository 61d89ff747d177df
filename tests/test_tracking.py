"""MLflow lineage against a real sqlite store in a temp dir: params, metric history, artifacts,
tags; a SIGKILLed and resumed run continues the same MLflow run with one curve; a corrupt store
never stops training."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, run_cli, run_main
from tpulab.checkpoint.files import MANIFEST
from tpulab.checkpoint.rundir import RunSummary
from tpulab.cli.main import main
from tpulab.evidence.metrics import read_records


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _artifacts(client, run_id, path=None):
    out = []
    for f in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return out


@pytest.mark.slow
def test_killed_and_resumed_run_is_one_mlflow_run_with_one_curve(tmp_path, capfd):
    from tpulab.checkpoint.store import manifest_digest
    from tpulab.proofs.driver import Proc, tpulab_argv

    run = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    argv = tpulab_argv(
        "train",
        "--config",
        TINY,
        "--run-dir",
        run,
        "--no-progress",
        "--steps",
        "20",
        "--set",
        "checkpoint.save_every=5",
    )
    with Proc(
        [*argv, "--hold-after-step", "13"], tmp_path / "killed.log"
    ) as proc:  # held after step 13 is logged
        deadline = time.monotonic() + 300
        # Checkpoint 10 committed too: under load its async save can still be in flight at step 13,
        # and the resume below must start from it.
        while not (
            (run / "mlflow_run.json").exists()
            and any(r.get("step") == 13 for r in read_records(run))
            and (run / "checkpoints" / "10" / MANIFEST).exists()
        ):
            assert proc.p.poll() is None and time.monotonic() < deadline, proc.tail()
            time.sleep(0.05)
        proc.kill(signal.SIGKILL)
    assert proc.p.returncode == -signal.SIGKILL
    first_id = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    # the resume runs in this process (run_main): the kill is what crosses the process boundary,
    # and the store holds nothing of the killed process but what it committed
    resumed = run_main(
        capfd,
        "train",
        "--config",
        TINY,
        "--run-dir",
        run,
        "--no-progress",
        "--steps",
        "20",
        "--set",
        "checkpoint.save_every=5",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "warning" not in resumed.stderr
    stored = json.loads((run / "mlflow_run.json").read_text())
    assert stored["run_id"] == first_id and stored["tracking_uri"] == uri

    recs = read_records(run)
    logged = [r["step"] for r in recs if "loss" in r]
    assert len(logged) > len(set(logged))  # control: metrics.jsonl really holds redone steps twice

    c = _client(uri)
    mlrun = c.get_run(first_id)
    assert mlrun.info.status == "FINISHED" and len(c.search_runs([mlrun.info.experiment_id])) == 1
    hist = c.get_metric_history(first_id, "loss")
    steps = [m.step for m in hist]
    assert sorted(steps) == list(range(1, 21))  # one curve: every step once, none duplicated
    final = {
        r["step"]: r["loss"] for r in recs if "loss" in r
    }  # the values of the lifetime that counts
    assert all(m.value == pytest.approx(final[m.step], rel=1e-6) for m in hist)
    assert [m.step for m in c.get_metric_history(first_id, "val_loss")] == [20]
    assert (
        len(c.get_metric_history(first_id, "lr")) == 20
        and len(c.get_metric_history(first_id, "grad_norm")) == 20
    )

    params, tags = mlrun.data.params, mlrun.data.tags
    assert (
        params["model.d_model"] == "32"
        and params["checkpoint.save_every"] == "5"
        and params["train.steps"] == "20"
    )
    docs = json.loads((run / "documents.json").read_text())
    env = json.loads((run / "env.json").read_text())
    assert tags["tpulab.corpus.identity"] == docs["identity"]
    assert (
        len(tags["tpulab.split.train_sha256"]) == 64
        and tags["tpulab.split.train_sha256"] != tags["tpulab.split.validation_sha256"]
    )
    assert (
        tags["tpulab.backend"] == env["backend"]
        and tags["tpulab.device_kind"] == env["device_kind"]
    )
    assert (
        tags["tpulab.version.jax"] == env["packages"]["jax"]
        and json.loads(tags["tpulab.tokenizer"])["kind"] == "bytes"
    )
    assert tags["tpulab.resume_count"] == "1"
    resume = json.loads(tags["tpulab.resume.1"])
    start = [r for r in recs if r.get("event") == "start"][-1]
    assert resume["from_checkpoint_step"] == start["resumed_from"] == 10
    assert resume["checkpoint_manifest_digest"] == start["checkpoint_digest"]
    assert resume["checkpoint_manifest_digest"] == manifest_digest(run / "checkpoints" / "10")
    arts = _artifacts(c, first_id)
    assert {
        "config.yaml",
        "env.json",
        "documents.json",
        "summary.json",
        "tpulab_manifest.json",
        "goodput.json",
    } <= set(arts)
    assert mlrun.data.metrics["goodput"] > 0

    capfd.readouterr()
    assert main(["runs", "--tracking-uri", uri]) == 0  # in process: the exit code main returns
    line = next(ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("run "))
    assert (
        "FINISHED" in line and " 20 " in line and env["backend"] in line and first_id[:12] in line
    )


def test_redone_steps_are_marked_not_duplicated(tmp_path):
    """A process that sent steps up to 15, then a resume from step 10 (an older checkpoint): the
    redone steps 11-15 go to redone/loss; the loss curve keeps each step once."""
    from tpulab.tracking.hook import MlflowTracker

    run = tmp_path / "run"
    run.mkdir()
    first = MlflowTracker(run)
    first.begin(params={"a": {"b": 1}})
    for s in range(1, 16):
        first.on_metrics(
            s, {"loss": float(s), "lr": 0.1, "grad_norm": 1.0, "tokens": 8, "wall_s": 0.1}
        )
    first.on_checkpoint(15)
    first.close()
    assert first.failed is None
    second = MlflowTracker(run)
    second.begin(params={"a": {"b": 1}}, resumed_from=10, digest="d" * 64)
    for s in range(11, 21):
        second.on_metrics(
            s, {"loss": 100.0 + s, "lr": 0.1, "grad_norm": 1.0, "tokens": 8, "wall_s": 0.1}
        )
    second.on_end(RunSummary(final_step=20, final_loss=120.0, latest_checkpoint=None))
    assert second.failed is None and second.run_id == first.run_id
    c = _client(first.uri)
    assert sorted(m.step for m in c.get_metric_history(first.run_id, "loss")) == list(range(1, 21))
    assert sorted(m.step for m in c.get_metric_history(first.run_id, "redone/loss")) == list(
        range(11, 16)
    )
    tag = json.loads(c.get_run(first.run_id).data.tags["tpulab.resume.1"])
    assert tag["steps_redone_marked"] == 5 and tag["checkpoint_manifest_digest"] == "d" * 64
    # control: steps held back (not covered by a checkpoint) are never sent by a process that dies
    third = MlflowTracker(tmp_path / "other")
    (tmp_path / "other").mkdir()
    third.begin(params={})
    third.on_metrics(1, {"loss": 1.0})
    third.close()  # like a kill: no checkpoint, no end
    assert c.get_metric_history(third.run_id, "loss") == []


def test_corrupt_store_warns_once_and_training_goes_on(tmp_path, capfd):
    """The tracked run trains in this process (``run_main``; MLflow itself runs in the tracker's
    helper process either way, its stderr read here); the refusal is a real process's, since
    --require-tracking opens the store in the trainer's own process."""
    db = tmp_path / "mlruns.db"
    db.write_bytes(b"this is not a sqlite database" * 100)
    before = db.read_bytes()
    run = tmp_path / "run"
    out = run_main(
        capfd,
        "train",
        "--config",
        TINY,
        "--run-dir",
        run,
        "--no-progress",
        "--steps",
        "10",
        "--set",
        "checkpoint.save_every=5",
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("warning: MLflow tracking off") == 1 and "Traceback" not in out.stderr
    assert (run / "checkpoints" / "10" / "tpulab_manifest.json").exists()
    assert db.read_bytes() == before and not (run / "mlflow_run.json").exists()

    refused = run_cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(tmp_path / "run2"),
        "--no-progress",
        "--steps",
        "10",
        "--require-tracking",
    )
    assert refused.returncode != 0
    assert (
        refused.stderr.startswith("error: cannot open the MLflow tracking store")
        and len(refused.stderr.splitlines()) == 1
    )
    assert not (tmp_path / "run2").exists()  # refused before anything was written


def test_no_track_and_unwritable_uri(tmp_path, capfd):
    """``--no-track`` in this process (``run_main``): nothing here is a process boundary."""
    out = run_main(
        capfd,
        "train",
        "--config",
        TINY,
        "--run-dir",
        tmp_path / "run",
        "--no-progress",
        "--steps",
        "5",
        "--no-track",
    )
    assert out.returncode == 0, out.stderr
    assert (
        not (tmp_path / "mlruns.db").exists()
        and not (tmp_path / "run" / "mlflow_run.json").exists()
    )
    capfd.readouterr()
    assert main(["runs", "--tracking-uri", f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}"]) != 0
    assert capfd.readouterr().err.startswith("error: no tracking store")


def test_mlflow_is_not_imported_for_help():
    import subprocess

    code = (
        "import sys; from tpulab.cli.main import build_parser; build_parser(); "
        "print('mlflow' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr


def test_only_process_zero_logs(tmp_path):
    from tpulab.tracking.hook import MlflowTracker

    run = tmp_path / "run"
    run.mkdir()
    other = MlflowTracker(run)
    other.on_start({"env": {"process_index": 1}, "config": None, "start_step": 0})
    other.on_metrics(1, {"loss": 1.0})
    other.on_checkpoint(1)
    other.on_end(RunSummary(final_step=1, latest_checkpoint=None))
    assert (
        other._worker is None
        and not (tmp_path / "mlruns.db").exists()
        and not (run / "mlflow_run.json").exists()
    )
    # as the loop calls it in process 1: the run files' env is process 0's alone, so it is empty
    loop_shaped = MlflowTracker(run)
    loop_shaped.on_start({"env": {}, "process_index": 1, "config": None, "start_step": 0})
    loop_shaped.on_metrics(1, {"loss": 1.0})
    assert loop_shaped._worker is None and not (tmp_path / "mlruns.db").exists()
    first = MlflowTracker(run)  # control: process 0 with the same calls does log
    first.on_start({"env": {"process_index": 0}, "config": None, "start_step": 0})
    first.on_metrics(1, {"loss": 1.0})
    first.on_end(RunSummary(final_step=1, latest_checkpoint=None))
    assert first.failed is None and (run / "mlflow_run.json").exists()
    from mlflow.tracking import MlflowClient

    assert len(MlflowClient(first.uri).get_metric_history(first.run_id, "loss")) == 1


def test_protocol_round_trip_and_refusal():
    """Both processes speak through one encoder/decoder: every message comes back equal and typed;
    a line that is not a message (the old ``[op, *args]`` form, an unknown type) is refused."""
    from tpulab.tracking import protocol as P

    messages = [
        P.Settings("run", "sqlite:///x.db", "transformer", {"tpulab.backend": "cpu"}),
        P.OpenRun({"model": {"d_model": 32}}, {"backend": "cpu"}, 10, "d" * 64),
        P.OpenRun({}, None, None, None),
        P.Send([P.Point("loss", 1.5, 3, 1700000000000), P.Point("kl", 0.25, 3, 1700000000001)]),
        P.Finish({"final_step": 3, "final_loss": 1.5, "preempted": False}),
        P.Terminate("FAILED"),
        P.Outcome("abc", None),
    ]
    for m in messages:
        line = P.encode(m)
        assert line.endswith("\n") and line.count("\n") == 1
        back = P.decode(line)
        assert type(back) is type(m) and back == m
    assert isinstance(P.decode(P.encode(messages[3])).points[0], P.Point)
    for bad in ('["_send", []]', '{"type": "_send", "points": []}', '{"points": []}'):
        with pytest.raises(ValueError, match="not a tracking message"):
            P.decode(bad)


def test_every_number_of_a_record_reaches_mlflow(tmp_path):
    """No fixed key list: every number the loop's record or an evaluation carries becomes a metric
    (``on_eval`` takes the metrics dict, or a float as ``val_loss``), and a resume backfills every
    number of the records a killed process committed but had not sent."""
    from tpulab.evidence.metrics import MetricsLog
    from tpulab.tracking.hook import MlflowTracker

    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLog(run)  # a killed process: steps 1-4 logged, checkpoint 3, nothing sent
    for s in range(1, 5):
        log.log(s, loss=1.0 / s, kl=0.1 * s, tokens=8)
    log.event("eval", step=3, val_loss=2.0, val_accuracy=0.5)
    log.close()
    t = MlflowTracker(run)
    t.begin(params={}, resumed_from=3)
    record = {"loss": 0.3, "kl": 0.45, "tokens": 8, "wall_s": 1.5, "reward": -1}
    t.on_metrics(4, {**record, "done": True, "note": "not a number"})
    t.on_eval(4, {"val_loss": 1.5, "val_accuracy": 0.75})
    t.on_metrics(5, {"loss": 0.2})
    t.on_eval(5, 1.25)  # what the loop passes today
    t.on_end(RunSummary(final_step=5, latest_checkpoint=None))
    assert t.failed is None
    c = _client(t.uri)

    def hist(key):
        return {m.step: m.value for m in c.get_metric_history(t.run_id, key)}

    assert hist("kl") == {1: 0.1, 2: 0.2, 3: 0.1 * 3, 4: 0.45}  # 4: the resumed process's value
    assert hist("tokens") == {s: 8 for s in range(1, 5)} and hist("reward") == {4: -1.0}
    assert hist("wall_s") == {4: 1.5}
    assert hist("loss") == {1: 1.0, 2: 0.5, 3: 1.0 / 3, 4: 0.3, 5: 0.2}
    assert hist("val_loss") == {3: 2.0, 4: 1.5, 5: 1.25} and hist("val_accuracy") == {
        3: 0.5,
        4: 0.75,
    }
    # control: non-numbers and metrics.jsonl's own step and segment fields are not metrics
    keys = set(c.get_run(t.run_id).data.metrics)
    assert {"loss", "kl"} <= keys and not keys & {"done", "note", "step", "segment"}


def test_progress_lines_take_eval_metrics_or_a_float():
    import io

    from tpulab.train.step_progress import LogLines

    out = io.StringIO()
    lines = LogLines(stream=out, force=True)
    lines.on_eval(10, {"val_loss": 1.23456, "val_accuracy": 0.5})
    lines.on_eval(20, 2.5)
    assert out.getvalue().splitlines() == [
        "[progress] step 10: val loss 1.2346, val accuracy 0.5000",
        "[progress] step 20: val loss 2.5000",
    ]


def test_cause_is_the_root_of_the_chain():
    """MLflow wraps SQLAlchemy wraps sqlite3: the line a user reads is the innermost one."""
    import sqlite3

    from tpulab.tracking.store import cause

    def chained():
        try:
            try:
                raise sqlite3.OperationalError("attempt to write a readonly database")
            except sqlite3.Error as e:
                raise RuntimeError("(sqlite3.OperationalError) attempt to write ...") from e
        except RuntimeError as e:
            raise ValueError("(raised as a result of Query-invoked autoflush; ...)\nmore") from e

    with pytest.raises(ValueError) as info:
        chained()
    assert cause(info.value) == "OperationalError: attempt to write a readonly database"
    assert cause(OSError("no space\nleft")) == "OSError: no space"  # control: no chain, first line
    assert cause(KeyError()) == "KeyError: KeyError"


@contextlib.contextmanager
def _unwritable(db):
    """Make a sqlite file unwritable for whoever runs the tests. chmod stops a normal user but not
    root (these tests may run as root): there the file gets the immutable flag (chattr +i), which
    stops root too. The premise is checked, not assumed: opening the file for writing must fail."""
    db.chmod(0o444)
    db.parent.chmod(0o555)
    root = os.geteuid() == 0
    if root:
        subprocess.run(["chattr", "+i", str(db)], check=True, capture_output=True)
    try:
        with pytest.raises(PermissionError):
            open(db, "r+b").close()
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(db)], check=True)
        db.parent.chmod(0o755)
        db.chmod(0o644)


def test_read_only_store_is_refused_before_step_zero_and_named_in_one_line(tmp_path, capfd):
    """--require-tracking writes to the store before training: a store that can be read but not
    written stops the run before step 0, naming sqlite's cause; without the flag the run's one
    warning names the same cause, not SQLAlchemy's autoflush note."""
    from tpulab.tracking.hook import MlflowTracker

    db = tmp_path / "store" / "mlruns.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    probe = f"from tpulab.tracking.store import require_writable; require_writable({uri!r})"
    ok = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert ok.returncode == 0 and db.exists(), ok.stderr  # control: a writable store passes
    run = tmp_path / "run"
    with _unwritable(db):
        before = db.read_bytes()
        refused = run_cli(
            "train",
            "--config",
            str(TINY),
            "--run-dir",
            str(run),
            "--no-progress",
            "--steps",
            "3",
            "--tracking-uri",
            uri,
            "--require-tracking",
        )
        assert refused.returncode != 0 and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith(f"error: cannot write to the MLflow tracking store {uri}")
        assert refused.stderr.rstrip().endswith(
            ": OperationalError: attempt to write a readonly database"
        )
        assert not (run / "checkpoints").exists() and not run.exists()  # nothing trained

        capfd.readouterr()
        tracker = MlflowTracker(tmp_path / "run-default", uri)  # the default: warn, train on
        tracker.begin(params={})
        tracker.close()
        err = capfd.readouterr().err
        assert tracker.failed == "OperationalError: attempt to write a readonly database"
        assert err.count("warning: MLflow tracking off") == 1 and tracker.failed in err, err
        assert "autoflush" not in err and len(err.splitlines()) == 1
        assert db.read_bytes() == before


def test_deleted_store_warning_names_the_cause(tmp_path, capfd):
    """A store deleted under a running tracker: sqlite refuses the next write (the file was
    unlinked); the one warning says so instead of SQLAlchemy's autoflush note."""
    from tpulab.tracking.hook import MlflowTracker

    run = tmp_path / "run"
    run.mkdir()
    tracker = MlflowTracker(run)
    tracker.begin(params={})
    tracker.on_metrics(1, {"loss": 1.0})
    tracker.on_checkpoint(1)
    deadline = time.monotonic() + 120
    db = tmp_path / "mlruns.db"
    while not (run / "mlflow_run.json").exists():  # the helper has the store open and a run in it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # its tags and step 1 are written (this test is about the next write)
    db.unlink()
    capfd.readouterr()
    tracker.on_metrics(2, {"loss": 0.5})
    tracker.on_end(RunSummary(final_step=2, final_loss=0.5, latest_checkpoint=None))
    err = capfd.readouterr().err
    assert tracker.failed == "OperationalError: attempt to write a readonly database", err
    assert err.count("warning: MLflow tracking off") == 1 and "autoflush" not in err


def _logged_run(d, steps, uri=None, send=None):
    """A run dir with ``steps`` in metrics.jsonl; with ``uri``, tracked there, with the tracker
    seeing only the first ``send`` of them (all by default)."""
    from tpulab.evidence.metrics import MetricsLog
    from tpulab.tracking.hook import MlflowTracker

    d.mkdir(parents=True)
    log = MetricsLog(d)
    for s in range(1, steps + 1):
        log.log(s, loss=1.0 / s, lr=0.1)
    log.event("eval", step=steps, val_loss=2.0)
    log.close()
    if uri is not None:
        t = MlflowTracker(d, uri)
        t.begin(params={})
        for s in range(1, (send or steps) + 1):
            t.on_metrics(s, {"loss": 1.0 / s, "lr": 0.1})
        t.on_eval(steps, 2.0)
        t.on_end(RunSummary(final_step=steps, latest_checkpoint=None))
        assert t.failed is None


def test_capstone_lists_runs_missing_from_the_store(tmp_path):
    """The capstone's tracking section: a run dir with no MLflow run, or with steps the store lacks,
    is a failure naming it; a complete one passes; the dossier's in-process runs are left out."""
    import shutil

    from tpulab.orchestrate.capstone import tracking_section

    out = tmp_path / "cap"
    uri = f"sqlite:///{out / 'mlruns.db'}"
    _logged_run(out / "run", 3, uri)
    _logged_run(out / "chaos" / "victim", 4, uri, send=3)  # lost its last step
    _logged_run(out / "proof" / "interrupted", 3)  # never tracked
    _logged_run(out / "dossier" / "run", 3)  # in-process, untracked by design
    text, failures = tracking_section(out, uri)
    assert len(failures) == 1 and failures[0].startswith("tracking: runs missing from the MLflow")
    assert "proof/interrupted (no mlflow_run.json" in failures[0]
    assert "chaos/victim (missing loss at 1 of 4 steps, lr at 1 of 4 steps)" in failures[0]
    assert "`run`" in text and "**1 of 3** runs complete" in text and "dossier/run" not in text
    shutil.rmtree(out / "chaos")
    shutil.rmtree(out / "proof")
    text, failures = tracking_section(out, uri)  # control: complete runs only
    assert failures == [] and "**1 of 1** runs complete" in text
    shutil.rmtree(out / "run")
    assert tracking_section(out, uri)[1][0].startswith("tracking: no training run")
