"""The whole TPU VM lifecycle against a recording stand-in gcloud (tests/fake_gcloud/gcloud, test code).

The stand-in simulates a 2-worker VM as two local home directories; `ssh --worker=all` runs the
command in each as a separate local process. tpulab itself runs unchanged: it builds its wheel,
copies it to the "workers", bootstraps a venv there (offline here: the dependencies come from this
venv through a .pth, the tpulab code from the staged wheel), runs the receipt and a real tiny CPU
training on each worker, fetches and verifies the checkpoints, deletes, and verifies deletion.

Until multi-process training exists, the two workers run INDEPENDENT single-process trainings (each
worker's receipt says process 0 of 1); `assert_independent_single_process_workers` checks exactly
that. When `tpulab launch` lands, this becomes one 2-process job and that assertion must change.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, run_cli
from tpulab.checkpoint.files import MANIFEST, verify_manifest
from tpulab.evidence.metrics import read_records

FAKE_DIR = REPO / "tests" / "fake_gcloud"
TPU_WORD = re.compile(r"\bTPU\b")
# Offline stand-in for the default bootstrap (which pip-installs jax[tpu] from the network): a real venv,
# the staged wheel installed into it, this venv's site-packages for the third-party dependencies.
# (--without-pip and the outer pip's --python: seconds faster per worker than seeding pip into each venv)
OFFLINE_BOOTSTRAP = ("set -e; cd {remote_dir}; {python} -m venv --without-pip .venv; "
                     f"echo {sysconfig.get_paths()['purelib']} > .venv/lib/python3.11/site-packages/_deps.pth; "
                     "{python} -m pip --python .venv/bin/python install -q --no-deps --no-index {wheel}")


@pytest.fixture
def fake_cloud(tmp_path, compile_cache_env):
    """State dir + env that puts the stand-in gcloud first on PATH; yields a writer for its config."""
    state = tmp_path / "fake-gcloud-state"
    state.mkdir()
    env = {"PATH": f"{FAKE_DIR}:{os.environ['PATH']}", "FAKE_GCLOUD_STATE": str(state)}

    def configure(**kw):
        conf = {"workers": 2, "creating_polls": 1, "pass_env": sorted(compile_cache_env), **kw}
        (state / "config.json").write_text(json.dumps(conf))

    configure()
    try:
        yield state, env, configure
    finally:
        # reap: no "worker" process (cwd inside the fake VM) may outlive the test, even after a timeout
        for pid in _pids_under(state):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(state / "nodes", ignore_errors=True)


def _pids_under(root: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.readlink(proc / "cwd").startswith(str(root)):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def cloud_yaml(tmp_path, **over) -> Path:
    cloud = {"project": "rehearsal-project", "zone": "us-central1-a", "name": "tpulab-rehearsal",
             "accelerator_type": "v5litepod-8", "runtime_version": "v2-alpha-tpuv5-lite", "poll_s": 0.05,
             "python": sys.executable, "bootstrap": OFFLINE_BOOTSTRAP, **over}
    path = tmp_path / "cloud.yaml"
    path.write_text(yaml.safe_dump({"cloud": cloud}))
    return path


def calls(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "cloud" / "calls.jsonl").read_text().splitlines()]


def fake_calls(state: Path) -> list[dict]:
    return [json.loads(x) for x in (state / "calls.jsonl").read_text().splitlines()]


def nodes_left(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "nodes").glob("*")) if (state / "nodes").exists() else []


def one_error_line(p) -> str:
    lines = p.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in p.stderr, p.stderr[-2000:]
    return lines[-1]


def form_signature(argv: list[str]) -> tuple:
    """verb, flag names, and whether --worker is all or one: what the real-parser test covered."""
    flags = sorted(a.split("=")[0] for a in argv if a.startswith("--"))
    worker = next((("all" if a == "--worker=all" else "N") for a in argv if a.startswith("--worker=")), None)
    return argv[4], tuple(flags), worker


def assert_independent_single_process_workers(receipts: list[dict]) -> None:
    """Two workers, each its own single-process JAX runtime: NOT yet one multi-process job."""
    assert len(receipts) == 2
    assert all(r["runtime"]["process_count"] == 1 and r["runtime"]["process_index"] == 0 for r in receipts)


@pytest.mark.slow
def test_up_full_cycle_with_preemption_rehearsal(tmp_path, fake_cloud):
    state, env, _ = fake_cloud
    out = tmp_path / "cloud-run"
    p = run_cli("tpu", "up", "--dir", str(out), "--cloud-config", str(cloud_yaml(tmp_path, expect="cpu",
                                                                                   expect_devices=1)),
                "--config", str(TINY), "--preempt-at", "12", "--worker-env", "0:TPULAB_WORKER=0",
                "--worker-env", "1:TPULAB_WORKER=1", env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    # The VM is gone, and tpulab verified it (describe NOT_FOUND, list without it).
    assert nodes_left(state) == []
    cleanup = json.loads((out / "cloud" / "cleanup.json").read_text())
    assert cleanup["verified_gone"] and cleanup["describe"] == "absent" and cleanup["listed_names"] == []

    # Every gcloud call is recorded, and every one reached the (stand-in) CLI exactly as recorded.
    recorded = calls(out)
    # (per-worker calls run in parallel, so the two logs agree as multisets, not in order)
    assert sorted(map(json.dumps, (c["argv"][1:] for c in recorded))) == \
        sorted(map(json.dumps, (c["argv"] for c in fake_calls(state))))
    assert all({"rc", "duration_s", "stdout", "stderr", "command"} <= set(c) for c in recorded)
    steps = [c["step"] for c in recorded]
    for expected in ("create", "create: wait for READY", "stage: copy", "stage: bootstrap", "run: receipt[worker 0]",
                     "run: job until preemption[worker 1]", "run: job (resume after preemption)[worker 0]",
                     "fetch[worker 0]", "fetch[worker 1]", "delete", "delete: verify (describe)",
                     "delete: verify (list)"):
        assert expected in steps, (expected, steps)
    # ...and each form is one the real gcloud parser accepted (tests/test_cloud_gcloud_parser.py).
    from tpulab.cloud.config import CloudConfig
    from tpulab.cloud.gcloud import command_forms
    tested = {form_signature(a) for a in command_forms(CloudConfig(project="p", zone="z")).values()}
    assert {form_signature(c["argv"]) for c in recorded} <= tested

    # Identity exactly as describe reported it.
    resource = json.loads((out / "cloud" / "resource.json").read_text())
    assert resource["accelerator_type"] == "v5litepod-8" and resource["state"] == "READY"
    assert resource["id"] == "4242424242424242" and len(resource["network_endpoints"]) == 2

    # Receipts from both workers, produced by the staged wheel (not this checkout), with per-worker env.
    receipts = [json.loads((out / "workers" / str(i) / "run" / "receipt" / "receipt.json").read_text())
                for i in range(2)]
    assert_independent_single_process_workers(receipts)
    for i, r in enumerate(receipts):
        assert r["runtime"]["backend"] == "cpu" and r["qualification"]["passed"]
        assert f"workers/{i}/home/tpulab/.venv/" in r["versions"]["tpulab_path"]
        assert r["env"]["TPULAB_WORKER"] == str(i)

    # Preempted by a real SIGTERM at/after step 12, resumed from the checkpoint it saved, finished at 40.
    fetch = json.loads((out / "cloud" / "fetch.json").read_text())
    assert fetch["passed"] and not fetch["salvage"]
    for w in fetch["workers"]:
        (stopped,) = w["preempted_at"]
        assert 12 <= stopped < 40 and w["segments"] == 2
        assert w["resumed_from"] == [None, stopped] and w["final_step"] == 40
        assert w["checkpoints"] and all(c["verified"] for c in w["checkpoints"])
        # independent re-check here, and a negative control: one flipped byte is caught
        ckpt = Path(w["run_dir"]) / w["checkpoints"][-1]["path"]
        verify_manifest(ckpt)
        corrupt = tmp_path / f"corrupt-{w['worker']}"
        shutil.copytree(ckpt, corrupt)
        victim = next(f for f in sorted(corrupt.rglob("*")) if f.is_file() and f.name != MANIFEST
                      and f.stat().st_size > 0)
        data = bytearray(victim.read_bytes())
        data[0] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(Exception, match="checksum mismatch"):
            verify_manifest(corrupt)

    # Both workers trained the same config independently and were preempted separately (often at different
    # steps), so bit-identical losses on every step also cross-check that each resume was exact.
    curves = [{r["step"]: r["loss"] for r in read_records(Path(w["run_dir"]) / "metrics.jsonl") if "loss" in r}
              for w in fetch["workers"]]
    assert sorted(curves[0]) == list(range(1, 41)) and curves[0] == curves[1]

    # The experiment log: identity, receipts, curve, verification, cleanup; never says TPU for a CPU run.
    log = (out / "experiment.md").read_text()
    assert not TPU_WORD.search(log)
    assert "Hardware, from 2 worker receipt(s): CPU (cpu) x1." in log
    assert "verified gone: **True**" in log and "all retrieved checkpoints verify" in log
    assert (out / "curve.png").stat().st_size > 0 and "4242424242424242" in log
    assert _pids_under(state) == []  # every worker process ended on its own


def test_create_failure_leaves_nothing_and_is_one_line(tmp_path, fake_cloud):
    state, env, configure = fake_cloud
    configure(fail={"create": "RESOURCE_EXHAUSTED: no capacity for v5litepod-8 in us-central1-a"})
    out = tmp_path / "run"
    p = run_cli("tpu", "up", "--dir", str(out), "--cloud-config", str(cloud_yaml(tmp_path)), env=env, timeout=120)
    assert p.returncode == 1
    line = one_error_line(p)
    assert line.startswith("error: create: could not create tpulab-rehearsal") and "RESOURCE_EXHAUSTED" in line
    cleanup = json.loads((out / "cloud" / "cleanup.json").read_text())
    assert cleanup["nothing_created"] and cleanup["verified_gone"]
    assert [c["step"] for c in calls(out)] == ["create", "cleanup: did create leave anything?"]
    assert nodes_left(state) == [] and not (out / "cloud" / "stage").exists()
    assert "create left nothing behind" in (out / "experiment.md").read_text()


@pytest.mark.slow
def test_run_failure_still_deletes(tmp_path, fake_cloud):
    """The default target for v5litepod-8 is tpu:v5e; the stand-in workers are CPU, so qualification fails
    on every worker, the job never starts, and the VM is still deleted and verified gone."""
    state, env, _ = fake_cloud
    out = tmp_path / "run"
    p = run_cli("tpu", "up", "--dir", str(out), "--cloud-config", str(cloud_yaml(tmp_path)), "--config", str(TINY),
                env=env, timeout=300)
    assert p.returncode == 1
    line = one_error_line(p)
    assert line.startswith("error: run: target qualification (tpu:v5e) failed on the workers")
    assert "expected backend tpu, JAX reports backend cpu" in line
    steps = [c["step"] for c in calls(out)]
    assert not any(s.startswith("run: job") for s in steps)  # the job never started
    assert steps[-3:] == ["delete", "delete: verify (describe)", "delete: verify (list)"]
    assert nodes_left(state) == [] and json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"]
    # The refusing receipts were salvaged before deletion: the log shows why, and claims no TPU.
    r = json.loads((out / "workers" / "0" / "run" / "receipt" / "receipt.json").read_text())
    assert r["qualification"]["passed"] is False and r["runtime"]["backend"] == "cpu"
    log = (out / "experiment.md").read_text()
    assert not TPU_WORD.search(log) and "qualified as `tpu:v5e x8`: False" in log
    assert "salvaged after the failure" in log


def test_delete_failure_is_loud(tmp_path, fake_cloud):
    state, env, configure = fake_cloud
    out = tmp_path / "run"
    cfg = cloud_yaml(tmp_path)
    p = run_cli("tpu", "create", "--dir", str(out), "--cloud-config", str(cfg), env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert nodes_left(state) == ["tpulab-rehearsal"]

    configure(fail={"delete": "PERMISSION_DENIED: tpu.nodes.delete"})
    p = run_cli("tpu", "delete", "--dir", str(out), env=env, timeout=120)  # config from DIR/cloud/
    assert p.returncode == 5
    line = one_error_line(p)
    assert "DELETE NOT VERIFIED: VM tpulab-rehearsal in project rehearsal-project, zone us-central1-a" in line
    assert "PERMISSION_DENIED" in line and shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "delete"]) in line

    # Negative control for the verification itself: a delete that reports success but deletes nothing.
    configure(delete_noop=True)
    p = run_cli("tpu", "delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 5 and "describe says 'present'" in one_error_line(p)
    assert json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"] is False

    configure()
    p = run_cli("tpu", "delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 0 and nodes_left(state) == []
    assert json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"] is True


def test_bad_cloud_input_is_one_line_and_calls_nothing(tmp_path, fake_cloud):
    state, env, _ = fake_cloud
    p = run_cli("tpu", "create", "--dir", str(tmp_path / "r"), "--set", "zone=us-central1-a", env=env, timeout=60)
    assert p.returncode == 2 and one_error_line(p) == ("error: cloud.project is not set (--set project=MY_PROJECT "
                                                       "or in the cloud config)")
    p = run_cli("tpu", "up", "--dir", str(tmp_path / "r2"), "--cloud-config", str(cloud_yaml(tmp_path)),
                "--job", "train --config {config}", env=env, timeout=60)
    assert p.returncode == 2 and "the job uses {config} but no --config was given" in one_error_line(p)
    assert not (state / "calls.jsonl").exists()


def test_step_commands_against_a_missing_vm_fail_in_one_line(tmp_path, fake_cloud):
    """stage/run/fetch parse their own options and report a VM that does not exist as one line."""
    state, env, _ = fake_cloud
    out = tmp_path / "run"
    (out / "cloud").mkdir(parents=True)
    (out / "cloud" / "resource.json").write_text(json.dumps({"network_endpoints": [{}, {}]}))
    base = ["--dir", str(out), "--cloud-config", str(cloud_yaml(tmp_path))]
    p = run_cli("tpu", "stage", *base, "--config", str(TINY), env=env, timeout=120)
    assert p.returncode == 1 and one_error_line(p).startswith("error: stage: could not prepare the remote directory")
    assert "NOT_FOUND" in one_error_line(p)
    p = run_cli("tpu", "run", *base, "--env", "A=1", "--worker-env", "1:B=2", env=env, timeout=120)
    assert p.returncode == 1 and "NOT_FOUND" in one_error_line(p)
    assert [c["step"] for c in calls(out)][-2:] in (["run: receipt[worker 0]", "run: receipt[worker 1]"],
                                                    ["run: receipt[worker 1]", "run: receipt[worker 0]"])
    earlier = out / "workers" / "0" / "run" / "metrics.jsonl"  # a copy fetched before: must survive
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}\n")
    p = run_cli("tpu", "fetch", *base, env=env, timeout=120)
    assert p.returncode == 1 and "could not retrieve run from worker 0" in one_error_line(p)
    assert earlier.read_text() == "{}\n" and sorted(x.name for x in (out / "workers").iterdir()) == ["0"]
    p = run_cli("tpu", "run", *base, "--worker-env", "x:B=2", env=env, timeout=60)
    assert p.returncode == 2 and one_error_line(p) == "error: --worker-env expects WORKER:NAME=VALUE, got 'x:B=2'"
