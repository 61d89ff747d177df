"""MLflow lineage against a real sqlite store in a temp dir: params, metric history, artifacts, tags;
a SIGKILLed and resumed run continues the same MLflow run with one curve; a corrupt store never stops training."""

import json
import signal
import sys
import time

import pytest

from conftest import REPO, TINY, run_cli
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
def test_killed_and_resumed_run_is_one_mlflow_run_with_one_curve(tmp_path):
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
        while not (
            (run / "mlflow_run.json").exists()
            and any(r.get("step") == 13 for r in read_records(run))
        ):
            assert proc.p.poll() is None and time.monotonic() < deadline, proc.tail()
            time.sleep(0.05)
        proc.kill(signal.SIGKILL)
    assert proc.p.returncode == -signal.SIGKILL
    first_id = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    resumed = run_cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
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

    listed = run_cli("runs", "--tracking-uri", uri)
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if ln.startswith("run "))
    assert (
        "FINISHED" in line and " 20 " in line and env["backend"] in line and first_id[:12] in line
    )


def test_redone_steps_are_marked_not_duplicated(tmp_path):
    """A process that sent steps up to 15, then a resume from step 10 (an older checkpoint): the redone
    steps 11-15 go to redone/loss; the loss curve keeps each step once."""
    from tpulab.tracking.mlflow_hook import MlflowTracker

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
    second.on_end({"final_step": 20, "final_loss": 120.0, "latest_checkpoint": None})
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


def test_corrupt_store_warns_once_and_training_goes_on(tmp_path):
    db = tmp_path / "mlruns.db"
    db.write_bytes(b"this is not a sqlite database" * 100)
    before = db.read_bytes()
    run = tmp_path / "run"
    out = run_cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
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


def test_no_track_and_unwritable_uri(tmp_path):
    out = run_cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(tmp_path / "run"),
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
    missing = run_cli("runs", "--tracking-uri", f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}")
    assert missing.returncode != 0 and missing.stderr.startswith("error: no tracking store")


def test_mlflow_is_not_imported_for_help():
    import subprocess

    code = "import sys; from tpulab.cli.main import build_parser; build_parser(); print('mlflow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr


def test_only_process_zero_logs(tmp_path):
    from tpulab.tracking.mlflow_hook import MlflowTracker

    run = tmp_path / "run"
    run.mkdir()
    other = MlflowTracker(run)
    other.on_start({"env": {"process_index": 1}, "config": None, "start_step": 0})
    other.on_metrics(1, {"loss": 1.0})
    other.on_checkpoint(1)
    other.on_end({"final_step": 1})
    assert (
        other._worker is None
        and not (tmp_path / "mlruns.db").exists()
        and not (run / "mlflow_run.json").exists()
    )
    # as the loop calls it in process 1: the run files' env is process 0's alone, so it comes empty there
    loop_shaped = MlflowTracker(run)
    loop_shaped.on_start({"env": {}, "process_index": 1, "config": None, "start_step": 0})
    loop_shaped.on_metrics(1, {"loss": 1.0})
    assert loop_shaped._worker is None and not (tmp_path / "mlruns.db").exists()
    first = MlflowTracker(run)  # control: process 0 with the same calls does log
    first.on_start({"env": {"process_index": 0}, "config": None, "start_step": 0})
    first.on_metrics(1, {"loss": 1.0})
    first.on_end({"final_step": 1})
    assert first.failed is None and (run / "mlflow_run.json").exists()
    from mlflow.tracking import MlflowClient

    assert len(MlflowClient(first.uri).get_metric_history(first.run_id, "loss")) == 1
