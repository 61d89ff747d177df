"""The cloud config section, job specs, and the worker-side preemption wrapper's refusal path."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli
from tpulab.cloud.config import CloudConfig, accelerator_target, load_cloud_config
from tpulab.cloud.job import JobSpec
from tpulab.errors import ConfigError, TpulabError


def test_accelerator_types_imply_receipt_targets():
    assert accelerator_target("v5litepod-8") == ("v5e", 8)
    assert accelerator_target("v6e-8") == ("v6e", 8)
    assert accelerator_target("v5p-8") == ("v5p", 4)  # megacore: 8 TensorCores, 4 JAX devices
    assert accelerator_target("v4-32") == ("v4", 16)
    assert accelerator_target("weird") == (None, None)
    assert CloudConfig(accelerator_type="v6e-8").target() == ("tpu:v6e", 8)
    assert CloudConfig(expect="cpu").target() == (
        "cpu",
        None,
    )  # an explicit target drops the implied count


def test_cloud_config_file_and_sets(tmp_path):
    path = tmp_path / "cloud.yaml"
    path.write_text("cloud:\n  project: p\n  zone: europe-west4-a\n  spot: true\n")
    cfg = load_cloud_config(path, ["name=my-vm", "cloud.accelerator_type=v6e-8"])
    assert (cfg.project, cfg.zone, cfg.name, cfg.spot, cfg.accelerator_type) == (
        "p",
        "europe-west4-a",
        "my-vm",
        True,
        "v6e-8",
    )
    example = load_cloud_config(REPO / "configs" / "cloud.example.yaml")
    assert example.target() == ("tpu:v5e", 8) and example.spot
    with pytest.raises(ConfigError, match="unknown config key 'cloud.projet'"):
        load_cloud_config(None, ["projet=p"])
    with pytest.raises(ConfigError, match="must be lower case"):
        load_cloud_config(None, ["name=My_VM"])
    with pytest.raises(ConfigError, match="exclusive"):
        load_cloud_config(None, ["spot=true", "preemptible=true"])
    with pytest.raises(ConfigError, match="cloud.project is not set"):
        CloudConfig(zone="z").require_target()


def test_job_spec_placeholders(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    job = JobSpec(config=cfg, run_name="r1")
    assert job.job_args() == [
        "train",
        "--run-dir",
        "runs/r1",
        "--no-progress",
        "--config",
        "stage/config.yaml",
    ]
    bridge = JobSpec(job="tpulab bridge prove-resume --backend torchax --run-dir {run_dir}")
    assert bridge.job_args() == [
        "bridge",
        "prove-resume",
        "--backend",
        "torchax",
        "--run-dir",
        "runs/run",
    ]
    with pytest.raises(TpulabError, match="plain directory name"):
        JobSpec(run_name="../x")
    with pytest.raises(TpulabError, match="config not found"):
        JobSpec(config=tmp_path / "missing.yaml")


def test_shared_dir_names_one_run_dir_for_every_worker(tmp_path):
    cfg = load_cloud_config(None, ["project=p", "zone=z", "shared_dir=/mnt/fs/"])
    assert cfg.shared_dir == "/mnt/fs/"
    job = JobSpec(run_name="r1")
    assert (
        job.remote_run_dir(cfg.shared_dir) == "/mnt/fs/runs/r1" and job.local_run_dir() == "runs/r1"
    )
    assert job.job_args(cfg.shared_dir)[:3] == ["train", "--run-dir", "/mnt/fs/runs/r1"]
    assert job.job_args() == [
        "train",
        "--run-dir",
        "runs/r1",
        "--no-progress",
    ]  # without: each worker's own disk
    with pytest.raises(ConfigError, match="must be an absolute path below /"):
        load_cloud_config(None, ["shared_dir=mnt/fs"])
    with pytest.raises(ConfigError, match="must be an absolute path below /"):
        load_cloud_config(None, ["shared_dir=/"])
    with pytest.raises(ConfigError, match=r"mount the bucket \(gcsfuse\) and name the mount point"):
        load_cloud_config(None, ["shared_dir=gs://bucket/runs"])


def test_worker_job_refuses_a_job_that_ends_before_the_preemption_step(tmp_path):
    """Negative control: if the SIGTERM never happened, the rehearsal must not pass as one."""
    run_dir = tmp_path / "r"
    p = run_cli(
        "tpu",
        "worker-job",
        "--run-dir",
        str(run_dir),
        "--preempt-at",
        "5",
        "--",
        "receipt",
        "--out",
        str(tmp_path / "receipt"),
        "--matmul-size",
        "32",
        timeout=120,
    )
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "error: the job ended (exit 0) at step None before the preemption "
        "step 5; choose a smaller --preempt-at"
    )
    assert json.loads((run_dir / "preempt.json").read_text())["signalled_after_logged_step"] is None
    # --record puts the record elsewhere (a worker's own disk when the run dir is shared)
    record = tmp_path / "local" / "preempt.json"
    p = run_cli(
        "tpu",
        "worker-job",
        "--run-dir",
        str(run_dir),
        "--preempt-at",
        "5",
        "--record",
        str(record),
        "--",
        "receipt",
        "--out",
        str(tmp_path / "receipt2"),
        "--matmul-size",
        "32",
        timeout=120,
    )
    assert p.returncode == 1 and json.loads(record.read_text())["preempt_at"] == 5


@pytest.mark.slow
def test_worker_job_accepts_a_stop_it_did_not_signal(tmp_path):
    """In a multi-process job a worker's process may stop on another process's notice.

    That can happen before this worker's wrapper saw the step (the shared metrics arrive late): the
    stop counts, and the record says who sent it. Here the test itself SIGTERMs the trainer (its pid
    from the start record) long before --preempt-at.
    """
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import TINY
    from tpulab.evidence.metrics import read_records

    run_dir, record = tmp_path / "r", tmp_path / "local" / "preempt.json"
    argv = [
        sys.executable,
        "-m",
        "tpulab.cli",
        "tpu",
        "worker-job",
        "--run-dir",
        str(run_dir),
        "--preempt-at",
        "39",
        "--record",
        str(record),
        "--",
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--no-track",
    ]
    wrapper = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("step", 0) >= 3 for r in read_records(run_dir / "metrics.jsonl")):
            assert wrapper.poll() is None and time.monotonic() < deadline, wrapper.communicate()
            time.sleep(0.05)
        (start,) = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("event") == "start"]
        os.kill(start["pid"], signal.SIGTERM)
        _, err = wrapper.communicate(timeout=120)
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
            wrapper.wait()
    assert wrapper.returncode == 0, err[-2000:]
    result = json.loads(record.read_text())
    assert result["signalled_after_logged_step"] is None and 3 <= result["preempted_at_step"] < 39
    assert (
        result["stopped_by"].startswith("a notice this wrapper did not send")
        and result["job_rc"] == 0
    )


def test_recorder_times_out_and_reaps_the_whole_group(tmp_path):
    """A hung call (gcloud and the ssh it started) is killed as a group, recorded with exit 124."""
    import os
    import time

    from tpulab.cloud.gcloud import Gcloud, read_calls

    pid_file = tmp_path / "grandchild.pid"
    rec = Gcloud(tmp_path / "cloud")
    t0 = time.monotonic()
    call = rec("hang", ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout_s=1.0)
    assert call.rc == 124 and time.monotonic() - t0 < 20 and "timed out after 1 s" in call.stderr
    grandchild = int(pid_file.read_text())
    for _ in range(100):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"grandchild {grandchild} survived the timeout")
    (record,) = read_calls(tmp_path / "cloud")
    assert record["rc"] == 124 and record["step"] == "hang" and record["argv"][0] == "bash"


def test_default_bootstrap_is_valid_shell_with_every_placeholder_filled():
    """The default bootstrap cannot run here (it needs the network); it must at least parse."""
    import subprocess

    from tpulab.cloud.config import DEFAULT_BOOTSTRAP

    cmd = DEFAULT_BOOTSTRAP.format(
        remote_dir="tpulab",
        python="python3",
        jax_version="0.10.2",
        wheel="stage/tpulab-0.1.0-py3-none-any.whl",
    )
    assert "{" not in cmd and "'jax[tpu]==0.10.2'" in cmd
    assert subprocess.run(["bash", "-n", "-c", cmd]).returncode == 0
    assert (
        subprocess.run(["bash", "-n", "-c", cmd + " 'unclosed"], capture_output=True).returncode
        != 0
    )
