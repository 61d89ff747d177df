"""The whole TPU VM lifecycle against a recording stand-in gcloud (tests/fake_gcloud/gcloud).

The stand-in simulates a 2-worker VM as two local home directories; `ssh --worker=all` runs the
command in each as a separate local process. It also plays the platform's part of a multi-host
slice: a directory every worker sees (standing in for a Filestore/NFS or gcsfuse mount). tpulab
itself runs unchanged: it builds its wheel, copies it to the "workers", bootstraps a venv there
(offline here: the dependencies come from this venv through a .pth, the tpulab code from the staged
wheel), checks that the shared dir is one directory, runs the receipt and a real tiny CPU training
as ONE 2-process JAX job (the coordinator named with --env/--worker-env, as on a cluster without
TPU cluster detection), rehearses a preemption both processes agree on, fetches and verifies the
shared checkpoints, deletes, and verifies deletion. `assert_one_multiprocess_job` checks the
receipts form one job; its negative control runs the same workers without the coordinator env.
Hung calls, SIGTERMs to real `tpulab tpu` processes and a lying describe test the failure paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, run_cli, set_explicitly
from tpulab.checkpoint.files import MANIFEST, verify_manifest
from tpulab.errors import ExitCode
from tpulab.evidence.metrics import read_records

FAKE_DIR = REPO / "tests" / "fake_gcloud"
TPU_WORD = re.compile(r"\bTPU\b")
# Offline stand-in for the default bootstrap (which pip-installs jax[tpu] from the network): a real
# venv, the staged wheel installed into it, this venv's site-packages for the third-party
# dependencies. (--without-pip and the outer pip's --python: seconds faster per worker than seeding
# pip into each venv)
OFFLINE_BOOTSTRAP = (
    "set -e; cd {remote_dir}; {python} -m venv --without-pip .venv; "
    f"echo {sysconfig.get_paths()['purelib']} > .venv/lib/python3.11/site-packages/_deps.pth; "
    "{python} -m pip --python .venv/bin/python install -q --no-deps --no-index {wheel}"
)


# Every tpulab command here runs in a network namespace of its own (`unshare -n`: loopback only,
# brought up for the 2-process job's coordinator and gloo), with a throwaway gcloud config and the
# stand-in named as cloud.gcloud (never found through PATH): even if the real CLI ran, it would have
# no credentials and no route. The test fails (never skips) where `unshare -n` does not work.
NETNS = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "netns"]
FAKE = FAKE_DIR / "gcloud"


def tpu_argv(*args: str) -> list[str]:
    return [*NETNS, sys.executable, "-m", "tpulab.cli", "tpu", *args]


def run_tpu(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`tpulab tpu ARGS` in its own network namespace, output captured."""
    return subprocess.run(
        tpu_argv(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=set_explicitly(dict(os.environ), env),
        cwd=REPO,
    )


def start_tpu(*args: str, env: dict) -> subprocess.Popen:
    """The same, started: the pid is tpulab's own (unshare and sh exec into it)."""
    return subprocess.Popen(
        tpu_argv(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=set_explicitly(dict(os.environ), env),
        cwd=REPO,
    )


@pytest.fixture(scope="session")
def netns():
    """`unshare -n` works here: a public address is unreachable, loopback is up."""
    probe = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "socket.create_connection(s.getsockname(), timeout=5).close()\n"
        "try:\n"
        "    socket.create_connection(('8.8.8.8', 53), timeout=2)\n"
        "except OSError as e:\n"
        "    print('isolated:', e)\n"
    )
    p = subprocess.run(
        [*NETNS, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and "isolated:" in p.stdout and "unreachable" in p.stdout.lower(), (
        f"`unshare -n` must give a namespace with loopback only: rc={p.returncode} "
        f"{p.stdout[-300:]} {p.stderr[-300:]}"
    )


@pytest.fixture
def fake_cloud(tmp_path, compile_cache_env, netns):
    """State dir + env of the stand-in gcloud (PATH untouched); yields a writer for its config."""
    state = tmp_path / "fake-gcloud-state"
    state.mkdir()
    (tmp_path / "gcloud-config").mkdir()
    env = {
        "FAKE_GCLOUD_STATE": str(state),
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud-config"),  # no account, no credentials
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
    }

    def configure(**kw):
        conf = {"workers": 2, "creating_polls": 1, "pass_env": sorted(compile_cache_env), **kw}
        (state / "config.json").write_text(json.dumps(conf))

    configure()
    try:
        yield state, env, configure
    finally:
        # reap: no "worker" process (cwd inside the fake VM) may outlive the test, even after a
        # timeout
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
    """The rehearsal's cloud config, checked to name the stand-in before any test uses it."""
    cloud = {
        "project": "rehearsal-project",
        "zone": "us-central1-a",
        "name": "tpulab-rehearsal",
        "accelerator_type": "v5litepod-8",
        "runtime_version": "v2-alpha-tpuv5-lite",
        "poll_s": 0.05,
        "python": sys.executable,
        "bootstrap": OFFLINE_BOOTSTRAP,
        "gcloud": str(FAKE),
        **over,
    }
    path = tmp_path / "cloud.yaml"
    path.write_text(yaml.safe_dump({"cloud": cloud}))
    assert_runs_the_stand_in(path)
    return path


def assert_runs_the_stand_in(cloud_config: Path) -> None:
    """The gcloud tpulab resolves from this config (as CloudSession does, with this process's PATH)
    is the stand-in; anything else (the real CLI) fails the test before a command starts."""
    from tpulab.cloud.config import load_cloud_config
    from tpulab.cloud.gcloud import resolve_gcloud

    resolved = resolve_gcloud(load_cloud_config(cloud_config).gcloud)
    assert Path(resolved).samefile(FAKE), f"{cloud_config} runs {resolved}, not the stand-in {FAKE}"


def calls(run_dir: Path) -> list[dict]:
    """tpulab's record of its gcloud calls; every one ran the stand-in."""
    recorded = [json.loads(x) for x in (run_dir / "cloud" / "calls.jsonl").read_text().splitlines()]
    assert {c["argv"][0] for c in recorded} <= {str(FAKE)}, {c["argv"][0] for c in recorded}
    return recorded


def fake_calls(state: Path) -> list[dict]:
    """The stand-in's own record of the calls it received (and that it was the one running)."""
    received = [json.loads(x) for x in (state / "calls.jsonl").read_text().splitlines()]
    assert {c["self"] for c in received} <= {str(FAKE.resolve())}
    return received


def nodes_left(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "nodes").glob("*")) if (state / "nodes").exists() else []


def one_error_line(p) -> str:
    lines = p.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in p.stderr, p.stderr[
        -2000:
    ]
    return lines[-1]


def form_signature(argv: list[str]) -> tuple:
    """verb, flag names, and whether --worker is all or one: what the real-parser test covered."""
    flags = sorted(a.split("=")[0] for a in argv if a.startswith("--"))
    worker = next(
        (("all" if a == "--worker=all" else "N") for a in argv if a.startswith("--worker=")), None
    )
    return argv[4], tuple(flags), worker


def receipts_of(out: Path, run_name: str = "run") -> list[dict]:
    """Each worker's receipt(s), fetched from its own disk (workers/I/RUN/receipt/)."""
    return [
        json.loads(p.read_text())
        for i in range(2)
        for p in sorted((out / "workers" / str(i) / run_name / "receipt").glob("receipt*.json"))
    ]


def assert_one_multiprocess_job(receipts: list[dict]) -> None:
    """The two workers are the two processes of ONE JAX job: process 0 and 1 of 2, the same global
    devices (the sum of the local ones), and a collective over all of them that summed to
    n(n+1)/2."""
    assert len(receipts) == 2
    rts = [r["runtime"] for r in receipts]
    assert [rt["process_count"] for rt in rts] == [2, 2], [rt["process_count"] for rt in rts]
    assert sorted(rt["process_index"] for rt in rts) == [0, 1]
    n = sum(rt["local_device_count"] for rt in rts)
    assert all(rt["device_count"] == n for rt in rts)
    assert (
        rts[0]["devices"] == rts[1]["devices"]
    )  # one global device list, the same in both processes
    assert sorted(i for rt in rts for i in rt["local_device_ids"]) == sorted(
        d["id"] for d in rts[0]["devices"]
    )
    for r in receipts:
        coll = r["evidence"]["collective"]
        assert coll["passed"] and coll["devices"] == n and coll["expected"] == n * (n + 1) / 2
        assert coll["values"] == [n * (n + 1) / 2] * r["runtime"]["local_device_count"]
        assert n > 1 and not coll["trivial"]


# The processes agree on the stop through JAX's coordination service, some steps after the signal (8
# steps, 0.16 s, measured here); the tiny job's later steps take ~10 ms each, so the signal comes
# early enough that the agreed stop cannot fall after step 40.
PREEMPT_AT = 5


def job_env(port: int) -> list[str]:
    """How the rehearsal forms the job: the coordinator env a slice's cluster detection replaces."""
    return [
        "--env",
        f"TPULAB_COORDINATOR=127.0.0.1:{port}",
        "--env",
        "TPULAB_NUM_PROCESSES=2",
        "--worker-env",
        "0:TPULAB_PROCESS_ID=0",
        "--worker-env",
        "1:TPULAB_PROCESS_ID=1",
    ]


@pytest.mark.slow
def test_up_full_cycle_with_preemption_rehearsal(tmp_path, fake_cloud):
    from tpulab.orchestrate.launch import free_port

    state, env, configure = fake_cloud
    shared = state / "shared-mount"  # the "Filestore" every worker sees; it outlives the VM
    configure(shared_mount=str(shared))
    out = tmp_path / "cloud-run"
    p = run_tpu(
        "up",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path, expect="cpu", expect_devices=2)),
        "--config",
        str(TINY),
        "--preempt-at",
        str(PREEMPT_AT),
        "--shared-dir",
        str(shared),
        *job_env(free_port()),
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]

    # The VM is gone, and tpulab verified it (describe NOT_FOUND, list without it).
    assert nodes_left(state) == []
    cleanup = json.loads((out / "cloud" / "cleanup.json").read_text())
    assert (
        cleanup["verified_gone"]
        and cleanup["describe"] == "absent"
        and cleanup["listed_names"] == []
    )

    # Every gcloud call is recorded, and every one reached the (stand-in) CLI exactly as recorded.
    recorded = calls(out)
    # (per-worker calls run in parallel, so the two logs agree as multisets, not in order)
    assert sorted(map(json.dumps, (c["argv"][1:] for c in recorded))) == sorted(
        map(json.dumps, (c["argv"] for c in fake_calls(state)))
    )
    assert all({"rc", "duration_s", "stdout", "stderr", "command"} <= set(c) for c in recorded)
    steps = [c["step"] for c in recorded]
    for expected in (
        "create",
        "create: wait for READY",
        "stage: copy",
        "stage: bootstrap",
        "run: shared dir (write on worker 0)",
        "run: shared dir (read on every worker)",
        "run: receipt[worker 0]",
        "run: job until preemption[worker 1]",
        "run: job (resume after preemption)[worker 0]",
        "fetch[worker 0]",
        "fetch[worker 1]",
        "fetch[shared run dir]",
        "delete",
        "delete: verify (describe)",
        "delete: verify (list)",
    ):
        assert expected in steps, (expected, steps)
    # ...and each form is one the real gcloud parser accepted (tests/test_cloud_gcloud_parser.py).
    from cloud_forms import command_forms
    from tpulab.cloud.config import CloudConfig

    tested = {form_signature(a) for a in command_forms(CloudConfig(project="p", zone="z")).values()}
    assert {form_signature(c["argv"]) for c in recorded} <= tested
    # the job ran in the shared dir: its run dir is SHARED/runs/run on every worker
    job_calls = [c for c in recorded if c["step"].startswith("run: job")]
    assert len(job_calls) == 4 and all(
        f"--run-dir {shared}/runs/run" in c["command"] for c in job_calls
    )

    # Identity exactly as describe reported it.
    resource = json.loads((out / "cloud" / "resource.json").read_text())
    assert resource["accelerator_type"] == "v5litepod-8" and resource["state"] == "READY"
    assert resource["id"] == "4242424242424242" and len(resource["network_endpoints"]) == 2

    # One receipt per worker, from its own disk, produced by the staged wheel (not this checkout):
    # together one 2-process job whose collective spanned both workers' devices, qualified as cpu x2
    # (global).
    receipts = receipts_of(out)
    assert_one_multiprocess_job(receipts)
    for i, r in enumerate(receipts):
        assert r["runtime"]["backend"] == "cpu" and r["qualification"]["passed"]
        assert r["qualification"]["target"] == "cpu x2" and r["runtime"]["process_index"] == i
        assert f"workers/{i}/home/tpulab/.venv/" in r["versions"]["tpulab_path"]
        assert r["env"]["TPULAB_PROCESS_ID"] == str(i)

    # One shared run dir, fetched once: preempted by a real SIGTERM at/after step 5 on BOTH workers,
    # the two processes stopped at one agreed step and saved it together, and resumed as 2 processes
    # to step 40.
    fetch = json.loads((out / "cloud" / "fetch.json").read_text())
    assert fetch["passed"] and not fetch["salvage"] and fetch["shared_dir"] == str(shared)
    (w,) = fetch["workers"]
    assert w["source"] == "shared run dir" and [d["worker"] for d in fetch["worker_dirs"]] == [0, 1]
    run_dir = out / "shared" / "run"
    assert (
        Path(w["run_dir"]) == run_dir
        and not (out / "workers" / "0" / "run" / "checkpoints").exists()
    )
    (stopped,) = w["preempted_at"]
    assert PREEMPT_AT <= stopped < 40 and w["segments"] == 2
    assert w["resumed_from"] == [None, stopped] and w["final_step"] == 40
    records = read_records(run_dir / "metrics.jsonl")
    assert [
        (r["process_index"], r["process_count"]) for r in records if r.get("event") == "start"
    ] == [(0, 2)] * 2
    # each worker's wrapper SIGTERM'd its own process (or, were it late, found it stopped on the
    # other's notice); both processes stopped at the one agreed step and exited 0
    rehearsals = [
        json.loads((out / "workers" / str(i) / "run" / "preempt.json").read_text())
        for i in range(2)
    ]
    assert all(r["job_rc"] == 0 and r["preempted_at_step"] == stopped for r in rehearsals)
    assert any(r["stopped_by"] == "this wrapper's SIGTERM" for r in rehearsals)
    assert all(
        r["signalled_after_logged_step"] is None or r["signalled_after_logged_step"] >= PREEMPT_AT
        for r in rehearsals
    )
    resumed = [r for r in records if r.get("event") == "start"][1]
    assert (
        resumed["resumed_from"] == stopped and resumed["checkpoint_digest"]
    )  # the agreed step's checkpoint
    assert w["checkpoints"] and all(c["verified"] for c in w["checkpoints"])
    for c in w[
        "checkpoints"
    ]:  # (keep=3: the agreed step's own checkpoint may be rotated out by 40)
        assert sorted(x.name for x in (run_dir / c["path"] / "data").glob("process_*")) == [
            "process_0-of-2.json",
            "process_1-of-2.json",
        ]  # both processes wrote into the one checkpoint
    # independent re-check here, and a negative control: one flipped byte is caught
    ckpt = run_dir / w["checkpoints"][-1]["path"]
    verify_manifest(ckpt)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    victim = next(
        f
        for f in sorted(corrupt.rglob("*"))
        if f.is_file() and f.name != MANIFEST and f.stat().st_size > 0
    )
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match="checksum mismatch"):
        verify_manifest(corrupt)

    # The preempted-and-resumed job's loss on every step 1..40 is bit-identical to an uninterrupted
    # 2-process job trained here by another route (tpulab launch, this checkout, no cloud, no
    # preemption).
    ref_dir = tmp_path / "reference"
    p = run_cli(
        "launch",
        "--processes",
        "2",
        "--devices-per-process",
        "1",
        "--log-dir",
        str(tmp_path / "ref-logs"),
        "--",
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(ref_dir),
        "--no-progress",
        "--no-track",
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    ref_records = read_records(ref_dir / "metrics.jsonl")
    assert [r["process_count"] for r in ref_records if r.get("event") == "start"] == [2]
    reference = {r["step"]: r["loss"] for r in ref_records if "loss" in r}
    rehearsed = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(rehearsed) == list(range(1, 41)) and rehearsed == reference

    # One MLflow run for the job (in the shared dir, next to the run dir): process 0 alone logs,
    # each step once.
    from mlflow.tracking import MlflowClient

    assert not any("MLflow tracking off" in c["stderr"] for c in recorded)
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    history = MlflowClient(f"sqlite:///{shared}/runs/mlruns.db").get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 41))
    assert {m.step: m.value for m in history} == pytest.approx(rehearsed, rel=1e-6)

    # The experiment log: identity, receipts, curve, verification, cleanup; never says TPU for a CPU
    # run.
    log = (out / "experiment.md").read_text()
    assert not TPU_WORD.search(log)
    assert (
        "Hardware, from 2 worker receipt(s): CPU (cpu) x2 (global devices of one 2-process "
        "JAX job)." in log
    )
    assert "verified gone: **True**" in log and "all retrieved checkpoints verify" in log
    assert f"shared run dir `{shared}/runs/run`" in log
    assert (out / "curve.png").stat().st_size > 0 and "4242424242424242" in log
    page = (
        out / "experiment.html"
    ).read_text()  # the same log as one page: curve embedded, nothing fetched
    assert "4242424242424242" in page and page.count("data:image/png;base64,") == 1
    assert not TPU_WORD.search(re.sub(r"data:[^\"']+", "", page))
    assert not re.search(r"""src=["'](?!data:)""", page)
    assert _pids_under(state) == []  # every worker process ended on its own


@pytest.mark.slow
def test_workers_without_the_coordinator_env_are_not_one_job(tmp_path, fake_cloud):
    """Negative control of the job check: the same workers and shared dir, no coordinator env. Each
    worker is its own single-process runtime: qualification as cpu x2 (global) refuses them before
    the job starts, the VM is still deleted, and the salvaged receipts fail
    `assert_one_multiprocess_job`."""
    state, env, configure = fake_cloud
    shared = state / "shared-mount"
    configure(shared_mount=str(shared))
    out = tmp_path / "run"
    p = run_tpu(
        "up",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path, expect="cpu", expect_devices=2)),
        "--config",
        str(TINY),
        "--shared-dir",
        str(shared),
        env=env,
        timeout=300,
    )
    assert p.returncode == 1
    line = one_error_line(p)
    assert line.startswith("error: run: target qualification (cpu) failed on the workers")
    assert "expected 2 devices, JAX reports 1" in line
    assert not any(c["step"].startswith("run: job") for c in calls(out))
    assert (
        nodes_left(state) == []
        and json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"]
    )
    receipts = receipts_of(out)
    assert [(r["runtime"]["process_index"], r["runtime"]["process_count"]) for r in receipts] == [
        (0, 1),
        (0, 1),
    ]
    with pytest.raises(AssertionError):
        assert_one_multiprocess_job(receipts)
    assert "(each worker its own single-process JAX runtime)" in (out / "experiment.md").read_text()
    assert _pids_under(state) == []


def test_a_shared_dir_that_is_not_shared_stops_the_run(tmp_path, fake_cloud):
    """The shared-dir check catches a path that is each host's own disk, and a missing mount."""
    state, env, configure = fake_cloud
    local = tmp_path / "not-mounted-everywhere"
    local.mkdir()
    configure(host_local=[str(local)])
    out = tmp_path / "run"
    p = run_tpu(
        "create",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path)),
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    for worker in range(
        2
    ):  # the mount point exists on every host, but as each host's own directory
        (
            state
            / "nodes"
            / "tpulab-rehearsal"
            / "workers"
            / str(worker)
            / "home"
            / "host-local"
            / str(local).lstrip("/")
        ).mkdir(parents=True)
    p = run_tpu(
        "run",
        "--dir",
        str(out),
        "--shared-dir",
        str(local),
        *job_env(1),
        env=env,
        timeout=120,
    )
    assert p.returncode == 1
    assert one_error_line(p).startswith(
        f"error: run: the shared dir {local} is not one directory on every worker"
    )
    p = run_tpu(
        "run",
        "--dir",
        str(out),
        "--shared-dir",
        str(tmp_path / "missing"),
        env=env,
        timeout=120,
    )
    assert p.returncode == 1
    assert one_error_line(p).startswith(
        f"error: run: cannot write to the shared dir {tmp_path / 'missing'} on "
        "worker 0 (is it mounted?)"
    )
    assert not (tmp_path / "missing").exists()
    steps = [c["step"] for c in calls(out)]
    assert not any(s.startswith(("run: receipt", "run: job")) for s in steps)  # nothing started
    p = run_tpu("run", "--dir", str(out), "--shared-dir", "gs://bucket/x", env=env, timeout=60)
    assert (
        p.returncode == 2
        and "mount the bucket (gcsfuse) and name the mount point" in one_error_line(p)
    )
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 0 and nodes_left(state) == []


def test_create_failure_leaves_nothing_and_is_one_line(tmp_path, fake_cloud):
    state, env, configure = fake_cloud
    configure(fail={"create": "RESOURCE_EXHAUSTED: no capacity for v5litepod-8 in us-central1-a"})
    out = tmp_path / "run"
    p = run_tpu(
        "up",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path)),
        env=env,
        timeout=120,
    )
    assert p.returncode == 1
    line = one_error_line(p)
    assert (
        line.startswith("error: create: could not create tpulab-rehearsal")
        and "RESOURCE_EXHAUSTED" in line
    )
    cleanup = json.loads((out / "cloud" / "cleanup.json").read_text())
    assert cleanup["nothing_created"] and cleanup["verified_gone"]
    assert [c["step"] for c in calls(out)] == ["create", "cleanup: did create leave anything?"]
    assert nodes_left(state) == [] and not (out / "cloud" / "stage").exists()
    assert "create left nothing behind" in (out / "experiment.md").read_text()


@pytest.mark.slow
def test_run_failure_still_deletes(tmp_path, fake_cloud):
    """The default target for v5litepod-8 is tpu:v5e; the stand-in workers are CPU, so
    qualification fails on every worker, the job never starts, and the VM is still deleted and
    verified gone."""
    state, env, _ = fake_cloud
    out = tmp_path / "run"
    p = run_tpu(
        "up",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path)),
        "--config",
        str(TINY),
        env=env,
        timeout=300,
    )
    assert p.returncode == 1
    line = one_error_line(p)
    assert line.startswith("error: run: target qualification (tpu:v5e) failed on the workers")
    assert "expected backend tpu, JAX reports backend cpu" in line
    steps = [c["step"] for c in calls(out)]
    assert not any(s.startswith("run: job") for s in steps)  # the job never started
    assert steps[-3:] == ["delete", "delete: verify (describe)", "delete: verify (list)"]
    assert (
        nodes_left(state) == []
        and json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"]
    )
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
    p = run_tpu("create", "--dir", str(out), "--cloud-config", str(cfg), env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert nodes_left(state) == ["tpulab-rehearsal"]

    configure(fail={"delete": "PERMISSION_DENIED: tpu.nodes.delete"})
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)  # config from DIR/cloud/
    assert p.returncode == ExitCode.DELETE_NOT_VERIFIED
    line = one_error_line(p)
    assert (
        "DELETE NOT VERIFIED: VM tpulab-rehearsal in project rehearsal-project, zone us-central1-a"
        in line
    )
    assert (
        "PERMISSION_DENIED" in line
        and shlex.join([str(FAKE), "compute", "tpus", "tpu-vm", "delete", "tpulab-rehearsal"])
        in line
    )

    # Negative control for the verification itself: a delete that reports success but deletes
    # nothing.
    configure(delete_noop=True)
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 5 and "describe says 'present'" in one_error_line(p)
    assert json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"] is False

    # describe answers exit 0 with no JSON (the VM is in fact deleted, list agrees): the message
    # blames describe, not list
    configure(describe_malformed=True)
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    line = one_error_line(p)
    assert (
        p.returncode == 5 and "describe says 'malformed' (exit 0, no JSON object: '<html>" in line
    )
    assert "list" not in line.split("DELETE NOT VERIFIED")[1].split("Delete it by hand")[0]

    configure()
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 0 and nodes_left(state) == []
    assert json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"] is True


def test_bad_cloud_input_is_one_line_and_calls_nothing(tmp_path, fake_cloud):
    state, env, _ = fake_cloud
    p = run_tpu(
        "create",
        "--dir",
        str(tmp_path / "r"),
        "--set",
        "zone=us-central1-a",
        env=env,
        timeout=60,
    )
    assert p.returncode == 2 and one_error_line(p) == (
        "error: cloud.project is not set (--set project=MY_PROJECT or in the cloud config)"
    )
    p = run_tpu(
        "up",
        "--dir",
        str(tmp_path / "r2"),
        "--cloud-config",
        str(cloud_yaml(tmp_path)),
        "--job",
        "train --config {config}",
        env=env,
        timeout=60,
    )
    assert (
        p.returncode == 2 and "the job uses {config} but no --config was given" in one_error_line(p)
    )
    assert not (state / "calls.jsonl").exists()


def test_step_commands_against_a_missing_vm_fail_in_one_line(tmp_path, fake_cloud):
    """stage/run/fetch parse their own options and report a VM that does not exist as one line."""
    state, env, _ = fake_cloud
    out = tmp_path / "run"
    (out / "cloud").mkdir(parents=True)
    (out / "cloud" / "resource.json").write_text(json.dumps({"network_endpoints": [{}, {}]}))
    base = ["--dir", str(out), "--cloud-config", str(cloud_yaml(tmp_path))]
    p = run_tpu("stage", *base, "--config", str(TINY), env=env, timeout=120)
    assert p.returncode == 1 and one_error_line(p).startswith(
        "error: stage: could not prepare the remote directory"
    )
    assert "NOT_FOUND" in one_error_line(p)
    p = run_tpu("run", *base, "--env", "A=1", "--worker-env", "1:B=2", env=env, timeout=120)
    assert p.returncode == 1 and "NOT_FOUND" in one_error_line(p)
    assert [c["step"] for c in calls(out)][-2:] in (
        ["run: receipt[worker 0]", "run: receipt[worker 1]"],
        ["run: receipt[worker 1]", "run: receipt[worker 0]"],
    )
    earlier = out / "workers" / "0" / "run" / "metrics.jsonl"  # a copy fetched before: must survive
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}\n")
    p = run_tpu("fetch", *base, env=env, timeout=120)
    assert p.returncode == 1 and "could not retrieve run from worker 0" in one_error_line(p)
    assert earlier.read_text() == "{}\n" and sorted(
        x.name for x in (out / "workers").iterdir()
    ) == ["0"]
    p = run_tpu("run", *base, "--worker-env", "x:B=2", env=env, timeout=60)
    assert (
        p.returncode == 2
        and one_error_line(p) == "error: --worker-env expects WORKER:NAME=VALUE, got 'x:B=2'"
    )


# --- isolation, bounds and stops (issue 19: items 9 and 21) -------------------------------------


def test_only_the_named_stand_in_can_run(tmp_path, monkeypatch):
    """The executable comes from cloud.gcloud, resolved once to an absolute path, and the guard
    that every config here passes refuses anything else: the default `gcloud` resolves to the real
    CLI on PATH (negative control), even with the stand-in's directory on PATH too."""
    from tpulab.cloud.lifecycle import CloudSession
    from tpulab.config import load
    from tpulab.errors import TpulabError

    real = tmp_path / "real.yaml"
    real.write_text(yaml.safe_dump({"cloud": {"project": "p", "zone": "z"}}))
    monkeypatch.setenv("PATH", f"/usr/bin:{FAKE_DIR}:{os.environ['PATH']}")
    with pytest.raises(AssertionError, match="not the stand-in"):
        assert_runs_the_stand_in(real)
    from tpulab.cloud.config import CloudFile

    cfg = load(CloudFile, cloud_yaml(tmp_path), []).cloud
    session = CloudSession(cfg, tmp_path / "out", env={"PATH": "/nonexistent"})
    assert session.cfg.gcloud == str(FAKE)  # not looked up on PATH at all
    with pytest.raises(TpulabError, match="gcloud executable not found: no-such-gcloud"):
        CloudSession(dataclasses.replace(cfg, gcloud="no-such-gcloud"), tmp_path / "out2")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _all_gone(pids: list[int], state: Path, within: float = 10) -> bool:
    """Every pid dead (a SIGKILLed process still has to be scheduled to exit: on this loaded 2-core
    machine that can take a moment) and nothing left running with its cwd in the fake VM."""
    deadline = time.monotonic() + within
    while any(_alive(pid) for pid in pids) or _pids_under(state):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _hung_pids(state: Path) -> list[list[int]]:
    """The stand-in calls that hang: [gcloud pid, its child's pid] each."""
    files = sorted((state / "hung").glob("*.json")) if (state / "hung").exists() else []
    return [[(r := json.loads(f.read_text()))["gcloud"], r["child"]] for f in files]


def _hung(state: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> list[int]:
    """Wait until N stand-in calls hang (each with its child); their pids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(found := _hung_pids(state)) >= n:
            return [pid for pair in found for pid in pair]
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.communicate()[1][-2000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {n} hung call(s) after {timeout} s")


def _ends(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_a_hung_call_is_bounded_by_call_timeout_s(tmp_path, fake_cloud):
    """ssh hangs while staging: the call ends at cloud.call_timeout_s (8 s here; before, the
    stage's fixed 600 s applied), its stand-in and child are killed, and the VM is deleted."""
    state, env, configure = fake_cloud
    configure(hang={"ssh": "mkdir -p"})
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = run_tpu(
        *("up", "--dir", str(out), "--config", str(TINY)),
        *("--cloud-config", str(cloud_yaml(tmp_path, call_timeout_s=8))),
        env=env,
        timeout=180,
    )
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-2000:]
    assert one_error_line(p).startswith(
        "error: stage: could not prepare the remote directory (gcloud exit 124: tpulab: timed out "
        "after 8 s"
    )
    recorded = calls(out)
    (hung,) = [c for c in recorded if c["step"] == "stage: prepare dirs"]
    assert hung["rc"] == 124 and 8 <= hung["duration_s"] < 20, hung
    assert all(c["timeout_s"] <= 8 for c in recorded)  # every call bounded, describe's 300 s too
    assert [c["step"] for c in recorded][-3:] == [
        "delete",
        "delete: verify (describe)",
        "delete: verify (list)",
    ]
    assert (
        nodes_left(state) == []
        and json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"]
    )
    ((gcloud, child),) = _hung_pids(state)
    assert _all_gone([gcloud, child], state) and took < 150


def test_sigterm_to_up_kills_the_hung_call_and_deletes_the_vm(tmp_path, fake_cloud):
    """A real SIGTERM to a real `tpulab tpu up` while its gcloud call hangs in stage: the call's
    process group is killed, the VM deleted and verified gone, exit 143, the last line names the
    VM. Before: the process died at once, the VM stayed, the hung stand-in was orphaned."""
    state, env, configure = fake_cloud
    configure(hang={"ssh": "mkdir -p"})
    out = tmp_path / "run"
    proc = start_tpu(
        *("up", "--dir", str(out), "--config", str(TINY)),
        *("--cloud-config", str(cloud_yaml(tmp_path))),
        env=env,
    )
    try:
        hung = _hung(state, 1, proc)
        assert all(_alive(pid) for pid in hung)
        proc.send_signal(signal.SIGTERM)
    finally:
        rc, err = _ends(proc, 60)
    assert rc == ExitCode.TERMINATED, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "error: terminated (SIGTERM) during stage: VM tpulab-rehearsal in project "
        "rehearsal-project, zone us-central1-a deleted and verified gone"
    )
    assert "Traceback" not in err
    recorded = calls(out)
    (stage,) = [c for c in recorded if c["step"] == "stage: prepare dirs"]
    assert stage["rc"] == 143 and "tpulab: terminated (SIGTERM)" in stage["stderr"]
    assert [c["step"] for c in recorded][-3:] == [
        "delete",
        "delete: verify (describe)",
        "delete: verify (list)",
    ]
    assert (
        nodes_left(state) == []
        and json.loads((out / "cloud" / "cleanup.json").read_text())["verified_gone"]
    )
    assert _all_gone(hung, state)


def test_sigterm_to_a_step_command_reaps_every_worker_call(tmp_path, fake_cloud):
    """`tpu run` with per-worker env runs one ssh per worker in threads; a SIGTERM reaches the main
    thread only, and still both hung calls (and their children) die; the step leaves the VM, and
    its last line names it and how to delete it."""
    state, env, configure = fake_cloud
    out = tmp_path / "run"
    p = run_tpu(
        "create",
        "--dir",
        str(out),
        "--cloud-config",
        str(cloud_yaml(tmp_path)),
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    configure(hang={"ssh": "receipt"})
    proc = start_tpu(
        "run", "--dir", str(out), "--worker-env", "0:A=1", "--worker-env", "1:A=2", env=env
    )
    try:
        hung = _hung(state, 2, proc)
        assert len(hung) == 4 and all(_alive(pid) for pid in hung)
        proc.send_signal(signal.SIGTERM)
    finally:
        rc, err = _ends(proc, 60)
    assert rc == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "error: terminated (SIGTERM) during tpu run: VM tpulab-rehearsal in project "
        "rehearsal-project, zone us-central1-a may exist and cost money (not verified deleted; "
        f"tpulab tpu delete --dir {out})"
    )
    assert _all_gone(hung, state)
    receipts = [c for c in calls(out) if c["step"].startswith("run: receipt")]
    assert len(receipts) == 2 and all(c["rc"] != 0 for c in receipts)
    assert nodes_left(state) == ["tpulab-rehearsal"]
    configure()
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 0 and nodes_left(state) == []


def test_a_sigterm_during_cleanup_does_not_cut_the_delete_short(tmp_path, fake_cloud):
    """SIGTERM during stage, then a second one while the delete hangs: the delete runs to its bound
    (8 s), and since it is not verified, exit 5 with the VM named and the first stop quoted."""
    state, env, configure = fake_cloud
    configure(hang={"ssh": "mkdir -p", "delete": ""})
    out = tmp_path / "run"
    proc = start_tpu(
        *("up", "--dir", str(out), "--config", str(TINY)),
        *("--cloud-config", str(cloud_yaml(tmp_path, call_timeout_s=8))),
        env=env,
    )
    try:
        _hung(state, 1, proc)
        proc.send_signal(signal.SIGTERM)
        _hung(state, 2, proc)  # the delete hangs now
        proc.send_signal(signal.SIGTERM)
    finally:
        rc, err = _ends(proc, 60)
    assert rc == 5, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "error: DELETE NOT VERIFIED: VM tpulab-rehearsal in project rehearsal-project, zone "
        "us-central1-a may still exist and cost money: delete exited 124"
    )
    assert line.endswith("(after an earlier failure: terminated (SIGTERM) during stage)")
    (delete,) = [c for c in calls(out) if c["step"] == "delete"]
    assert delete["rc"] == 124 and delete["duration_s"] >= 8  # ran to its bound, not cut short
    assert _all_gone([pid for pair in _hung_pids(state) for pid in pair], state)
    configure()
    p = run_tpu("delete", "--dir", str(out), env=env, timeout=120)
    assert p.returncode == 0 and nodes_left(state) == []
