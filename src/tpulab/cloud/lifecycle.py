"""The TPU VM lifecycle through the real gcloud CLI: create, stage, run, fetch, delete.

Every step writes what the cloud or the runtime reported under ``DIR/cloud/`` (resource.json,
staged.json, run.json, fetch.json, cleanup.json, and calls.jsonl for every gcloud call), so the
experiment log can point each claim at its raw evidence. Every gcloud call is bounded by
``cloud.call_timeout_s`` (and by a shorter fixed bound per step where one applies). What runs is
a ``JobSpec`` (``cloud.job``), staged with the project's wheel (``cloud.wheel``). ``up``
(``cloud.up``: all the steps) deletes after any failure, Ctrl-C and SIGTERM included (its gcloud
children are killed first), and a deletion that cannot be verified is reported loudly with the
resource named; an interrupted step command names the VM it leaves behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import secrets
import shlex
import shutil
import threading
import time
from pathlib import Path

from tpulab.checkpoint.files import (
    MANIFEST,
    atomic_write_json,
    manifest_digest,
    sha256_file,
    verify_manifest,
)
from tpulab.checkpoint.rundir import RunDir, read_json
from tpulab.cloud.config import CloudConfig
from tpulab.cloud.gcloud import (
    Call,
    Gcloud,
    create_argv,
    delete_argv,
    describe_argv,
    interruption,
    list_argv,
    resolve_gcloud,
    scp_from_argv,
    scp_to_argv,
    sigterm_as_interrupt,
    ssh_argv,
)
from tpulab.cloud.job import JobSpec, env_prefix
from tpulab.cloud.wheel import build_wheel
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.evidence.provenance import git_commit

FAIL_STATES = {"PREEMPTED", "TERMINATED", "DELETING", "STOPPED", "STOPPING", "HIDDEN"}


class CloudError(TpulabError):
    """A lifecycle step failed; the message names the step and gcloud's last line."""

    exit_code = ExitCode.FAILED


class DeleteError(TpulabError):
    """The VM may still exist (and cost money): resource named, manual command given."""

    exit_code = ExitCode.DELETE_NOT_VERIFIED


class Interrupted(TpulabError):
    """SIGTERM or Ctrl-C ended a step (``ExitCode.TERMINATED``, ``INTERRUPTED``), the VM named
    (deleted or not)."""


class CloudSession:
    """One TPU VM, one local run directory ``out_dir``; each method is one lifecycle step."""

    def __init__(
        self, cfg: CloudConfig, out_dir: str | Path, *, env: dict | None = None, echo=None
    ):
        cfg.require_target()
        # the binary named, not whichever PATH finds first later: every call record shows it
        self.cfg = dataclasses.replace(cfg, gcloud=resolve_gcloud(cfg.gcloud, env))
        self.dir = Path(out_dir)
        self.cloud_dir = self.dir / "cloud"
        self.gcloud = Gcloud(
            self.cloud_dir, env=env, echo=echo, max_timeout_s=self.cfg.call_timeout_s
        )
        self.echo = echo or (lambda _msg: None)

    # --- helpers ----------------------------------------------------------------------------
    def write_record(self, name: str, obj) -> None:
        atomic_write_json(self.cloud_dir / name, obj)

    def _gcloud_failure(self, step: str, call: Call, what: str) -> CloudError:
        """The error to raise for a failed gcloud call: the step, what failed, its exit and tail."""
        return CloudError(
            f"{step}: {what} (gcloud exit {call.rc}: {call.tail()}; see {self.gcloud.path})"
        )

    def resource(self) -> str:
        return f"VM {self.cfg.name} in project {self.cfg.project}, zone {self.cfg.zone}"

    @contextlib.contextmanager
    def interruptible(self, step: str):
        """One step command (``tpu create``, ``run``, ...): SIGTERM acts like Ctrl-C, every gcloud
        child is killed, and the one-line error names the VM, which the step does not delete."""
        with sigterm_as_interrupt():
            try:
                yield
            except KeyboardInterrupt as e:
                self.gcloud.kill_all()
                how, code = interruption(e)
                raise Interrupted(
                    f"{how} during tpu {step}: {self.resource()} may exist and cost money "
                    f"(not verified deleted; tpulab tpu delete --dir {self.dir})",
                    exit_code=code,
                ) from None

    def remote(self, args: list[str], env: dict | None = None) -> str:
        """The shell command a worker runs: in the staged dir, with the staged venv's tpulab."""
        tpulab = shlex.join([".venv/bin/tpulab", *args])
        return f"cd {self.cfg.remote_dir} && {env_prefix(env or {})}{tpulab}"

    def ssh_all(self, step: str, command, timeout_s: float | None = None) -> list[Call]:
        """One ``--worker=all`` call, or one call per worker in parallel when ``command`` is a
        function of the worker index (per-worker environment)."""
        timeout = timeout_s or self.cfg.call_timeout_s
        if isinstance(command, str):
            return [self.gcloud(step, ssh_argv(self.cfg, command), timeout)]
        calls: list = [None] * self.workers()
        finished = [threading.Event() for _ in calls]

        def one(i: int) -> None:
            try:
                calls[i] = self.gcloud(
                    f"{step}[worker {i}]", ssh_argv(self.cfg, command(i), worker=i), timeout
                )
            except TpulabError as e:
                calls[i] = e
            finally:
                finished[i].set()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        # Events, not join(): a join interrupted by Ctrl-C/SIGTERM marks the thread stopped while
        # it runs (CPython 3.11, bpo-45274), so a second join returns before its call is recorded.
        try:
            for f in finished:
                f.wait()
        except BaseException:  # the signal reaches the main thread only: end the others' calls
            self.gcloud.kill_all()
            for f in finished:
                f.wait()
            raise
        for t in threads:
            t.join()
        for c in calls:
            if isinstance(c, TpulabError):
                raise c
        return calls

    def describe(self, step: str = "describe") -> tuple[str, dict | None, Call]:
        """('present', data); ('absent', None) when gcloud says NOT_FOUND; ('malformed', None) for
        exit 0 without a JSON object; ('unknown', None) for any other failure."""
        call = self.gcloud(step, describe_argv(self.cfg), 300)
        if call.ok:
            try:
                data = json.loads(call.stdout)
            except ValueError:
                data = None
            return ("present", data, call) if isinstance(data, dict) else ("malformed", None, call)
        text = call.stderr + call.stdout
        if "NOT_FOUND" in text or "not found" in text.lower():
            return "absent", None, call
        return "unknown", None, call

    def workers(self) -> int:
        resource = read_json(self.cloud_dir / "resource.json", None)
        if resource is None:
            raise CloudError(
                f"no {self.cloud_dir / 'resource.json'}: run `tpulab tpu create` first"
            )
        return max(1, len(resource.get("network_endpoints") or []))

    # --- create -----------------------------------------------------------------------------
    def create(self) -> dict:
        self.echo(
            f"creating {self.cfg.name} ({self.cfg.accelerator_type}, {self.cfg.runtime_version}) "
            f"in {self.cfg.project}/{self.cfg.zone}"
        )
        call = self.gcloud("create", create_argv(self.cfg), self.cfg.ready_timeout_s)
        if not call.ok:
            raise self._gcloud_failure("create", call, f"could not create {self.cfg.name}")
        return self.wait_ready()

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while True:
            state, data, call = self.describe("create: wait for READY")
            if state == "present" and data.get("state") == "READY":
                return self.record_identity(data)
            if state == "present" and data.get("state") in FAIL_STATES:
                raise self._gcloud_failure(
                    "create", call, f"{self.cfg.name} is {data.get('state')}, not READY"
                )
            if state == "absent":
                raise self._gcloud_failure(
                    "create", call, f"{self.cfg.name} vanished while waiting for READY"
                )
            if time.monotonic() > deadline:
                last = _describe_problem(state, call) if state != "present" else data.get("state")
                raise self._gcloud_failure(
                    "create",
                    call,
                    f"{self.cfg.name} not READY after {self.cfg.ready_timeout_s:.0f} s "
                    f"(last describe: {last})",
                )
            time.sleep(self.cfg.poll_s)

    def record_identity(self, data: dict) -> dict:
        """resource.json: the identity exactly as ``describe --format=json`` reported it."""
        sched = data.get("schedulingConfig") or {}
        identity = {
            "project": self.cfg.project,
            "zone": self.cfg.zone,
            "name": self.cfg.name,
            "full_name": data.get("name"),
            "id": data.get("id"),
            "accelerator_type": data.get("acceleratorType"),
            "runtime_version": data.get("runtimeVersion"),
            "state": data.get("state"),
            "create_time": data.get("createTime"),
            "health": data.get("health"),
            "network_endpoints": data.get("networkEndpoints") or [],
            "spot": bool(sched.get("spot")),
            "preemptible": bool(sched.get("preemptible")),
            "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": "gcloud compute tpus tpu-vm describe --format=json (calls.jsonl)",
            "describe": data,
        }
        if identity["accelerator_type"] != self.cfg.accelerator_type:
            raise CloudError(
                f"create: {self.cfg.name} reports accelerator type {identity['accelerator_type']}, "
                f"asked for {self.cfg.accelerator_type}"
            )
        self.write_record("resource.json", identity)
        return identity

    # --- stage ------------------------------------------------------------------------------
    def stage(self, job: JobSpec) -> dict:
        """Wheel + config + corpus to every worker, then the venv bootstrap on every worker."""
        local = self.cloud_dir / "stage"
        if local.exists():
            shutil.rmtree(local)
        local.mkdir(parents=True)
        wheel = build_wheel(local)
        if job.config is not None:
            shutil.copyfile(job.config, RunDir(local).config)
        if job.data is not None:
            (local / "data").mkdir()
            src = Path(job.data)
            (shutil.copytree if src.is_dir() else shutil.copyfile)(src, local / "data" / src.name)
        rd = self.cfg.remote_dir
        call = self.ssh_all("stage: prepare dirs", f"mkdir -p {rd}/runs && rm -rf {rd}/stage", 600)[
            0
        ]
        if not call.ok:
            raise self._gcloud_failure("stage", call, "could not prepare the remote directory")
        call = self.gcloud("stage: copy", scp_to_argv(self.cfg, [str(local)], f"{rd}/"), 3600)
        if not call.ok:
            raise self._gcloud_failure(
                "stage", call, "could not copy the wheel and config to the workers"
            )
        bootstrap = self.cfg.bootstrap.format(
            remote_dir=rd,
            python=self.cfg.python,
            wheel=f"stage/{wheel.name}",
            jax_version=importlib.metadata.version("jax"),
        )
        call = self.ssh_all("stage: bootstrap", bootstrap, 3600)[0]
        if not call.ok:
            raise self._gcloud_failure(
                "stage", call, "bootstrapping the venv on the workers failed"
            )
        staged = {
            "wheel": wheel.name,
            "wheel_sha256": sha256_file(wheel),
            "tpulab_commit": git_commit(),
            "config": str(job.config) if job.config else None,
            "config_sha256": sha256_file(RunDir(local).config) if job.config else None,
            "data": str(job.data) if job.data else None,
            "remote_dir": rd,
            "jax_version": importlib.metadata.version("jax"),
            "bootstrap": bootstrap,
        }
        self.write_record("staged.json", staged)
        return staged

    # --- run --------------------------------------------------------------------------------
    def qualify(self, job: JobSpec) -> None:
        """``tpulab receipt --expect`` on every worker, into each worker's own run dir: with the
        job's env, so in a multi-process job the receipts join it and the collective spans every
        global device."""
        expect, devices = self.cfg.target()
        args = ["receipt", "--out", f"{job.local_run_dir()}/receipt", "--expect", expect]
        if devices is not None:
            args += ["--expect-devices", str(devices)]
        for call in self._ssh_job("run: receipt", args, job):
            if not call.ok:
                raise self._gcloud_failure(
                    "run",
                    call,
                    f"target qualification ({expect}) failed on the workers; the job "
                    "was not started",
                )

    def _ssh_job(self, step: str, args: list[str], job: JobSpec) -> list[Call]:
        if job.worker_env:
            return self.ssh_all(
                step, lambda i: self.remote(args, {**job.env, **job.worker_env.get(i, {})})
            )
        return self.ssh_all(step, self.remote(args, job.env))

    def check_shared(self, job: JobSpec) -> dict:
        """The shared dir is one directory on every worker: worker 0 writes a fresh marker into the
        run dir there, every worker must read it back. A path that is each host's own disk (a mount
        that is missing on some host) would split one job's checkpoint across hosts; this stops the
        run before anything starts."""
        shared = self.cfg.shared_dir
        run_dir = job.remote_run_dir(shared)
        marker, nonce = f"{run_dir}/.tpulab-shared-check", secrets.token_hex(8)
        q = shlex.quote
        write = f"test -d {q(shared)} && mkdir -p {q(run_dir)} && echo {nonce} > {q(marker)}"
        call = self.gcloud(
            "run: shared dir (write on worker 0)",
            ssh_argv(self.cfg, write, worker=0),
            self.cfg.call_timeout_s,
        )
        if not call.ok:
            raise self._gcloud_failure(
                "run", call, f"cannot write to the shared dir {shared} on worker 0 (is it mounted?)"
            )
        call = self.ssh_all(
            "run: shared dir (read on every worker)", f'test "$(cat {q(marker)})" = {nonce}'
        )[0]
        if not call.ok:
            raise self._gcloud_failure(
                "run",
                call,
                f"the shared dir {shared} is not one directory on every worker: worker "
                "0's marker is missing elsewhere (mount the same Filestore/NFS export or "
                "gcsfuse bucket at that path on every worker)",
            )
        return {
            "shared_dir": shared,
            "run_dir": run_dir,
            "marker": marker,
            "nonce": nonce,
            "seen_by": f"all {self.workers()} workers",
        }

    def run(self, job: JobSpec, preempt_at: int | None = None) -> dict:
        """Receipt with --expect on all workers first, then the job on all workers (resuming after
        a rehearsed preemption when ``preempt_at`` is given). With ``cloud.shared_dir`` the job's
        run dir is the shared one (checked first); receipts and rehearsal records stay on each
        worker's disk."""
        shared = self.cfg.shared_dir
        args = job.job_args(shared)
        record = {
            "job": args,
            "run_dir": job.remote_run_dir(shared),
            "shared_dir": shared,
            "env": job.env,
            "worker_env": {str(k): v for k, v in job.worker_env.items()},
            "preempt_at": preempt_at,
            "target": self.cfg.target()[0],
            "segments": [],
        }
        self.write_record("run.json", record)
        if shared:
            record["shared_check"] = self.check_shared(job)
            self.write_record("run.json", record)
        self.qualify(job)
        if preempt_at is not None:
            wrapped = job.rehearsal_args(shared, preempt_at)
            for call in self._ssh_job("run: job until preemption", wrapped, job):
                if not call.ok:
                    raise self._gcloud_failure(
                        "run", call, f"the preemption rehearsal at step {preempt_at} failed"
                    )
            record["segments"].append("preempted")
            self.write_record("run.json", record)
        step = "run: job (resume after preemption)" if preempt_at is not None else "run: job"
        for call in self._ssh_job(step, args, job):
            if not call.ok:
                raise self._gcloud_failure("run", call, "the job failed on the workers")
        record["segments"].append("completed")
        self.write_record("run.json", record)
        return record

    # --- fetch ------------------------------------------------------------------------------
    def fetch(self, run_name: str, strict: bool = True) -> dict:
        """Each worker's own ``runs/NAME`` to DIR/workers/<i>/ and, with a shared dir, the job's
        shared run dir once (from worker 0) to DIR/shared/; every retrieved checkpoint manifest
        verified here.

        ``strict=False`` is the salvage after a failed run: keep what can be retrieved (the failing
        receipt, partial metrics) and raise nothing."""
        shared = self.cfg.shared_dir
        sources = [
            (
                f"worker {i}",
                i,
                f"{self.cfg.remote_dir}/runs/{run_name}",
                self.dir / "workers" / str(i),
            )
            for i in range(self.workers())
        ]
        if shared:
            sources.append(
                ("shared run dir", 0, f"{shared.rstrip('/')}/runs/{run_name}", self.dir / "shared")
            )
        results, worker_dirs = [], []
        for label, worker, remote, dest in sources:
            got = self._fetch_one(label, worker, remote, dest, run_name, strict)
            if got is None:
                continue
            if (
                shared and label != "shared run dir"
            ):  # receipts and rehearsal records only: nothing to verify
                worker_dirs.append({"worker": worker, "run_dir": str(got)})
            else:
                results.append({"source": label, **verify_fetched(got, worker)})
        report = {
            "run_name": run_name,
            "shared_dir": shared,
            "workers": results,
            "worker_dirs": worker_dirs,
            "passed": bool(results)
            and all(
                w["checkpoints"] and all(c["verified"] for c in w["checkpoints"]) for w in results
            ),
        }
        report["salvage"] = not strict
        self.write_record("fetch.json", report)
        if strict and not report["passed"]:
            bad = next(
                w
                for w in results
                if not w["checkpoints"] or not all(c["verified"] for c in w["checkpoints"])
            )
            why = next(
                (c["error"] for c in bad["checkpoints"] if not c["verified"]),
                "no checkpoint retrieved",
            )
            raise CloudError(f"fetch: {bad['source']}: {why}")
        return report

    def _fetch_one(
        self, label: str, worker: int, remote: str, dest: Path, run_name: str, strict: bool
    ) -> Path | None:
        incoming = (
            dest.parent / f".incoming-{dest.name}"
        )  # a failed fetch must not cost an earlier copy
        if incoming.exists():
            shutil.rmtree(incoming)
        incoming.mkdir(parents=True)
        call = self.gcloud(
            f"fetch[{label}]",
            scp_from_argv(self.cfg, remote, str(incoming) + "/", worker=worker),
            3600,
        )
        if not call.ok or not (incoming / run_name).is_dir():
            shutil.rmtree(incoming)
            if not strict:
                return None
            what = run_name if label.startswith("worker") else f"the shared run dir {remote}"
            raise self._gcloud_failure(
                "fetch", call, f"could not retrieve {what} from worker {worker}"
            )
        dest.mkdir(parents=True, exist_ok=True)
        if (dest / run_name).exists():
            shutil.rmtree(dest / run_name)
        (incoming / run_name).rename(dest / run_name)
        shutil.rmtree(incoming)
        return dest / run_name

    # --- delete -----------------------------------------------------------------------------
    def delete(self) -> dict:
        """Delete, then verify it is gone: describe says NOT_FOUND, list does not show the name."""
        call = self.gcloud("delete", delete_argv(self.cfg), 3600)
        already_gone = not call.ok and "NOT_FOUND" in (call.stderr + call.stdout)
        state, _, described = self.describe("delete: verify (describe)")
        listed = self.gcloud("delete: verify (list)", list_argv(self.cfg), 300)
        names = _listed_names(listed.stdout) if listed.ok else None
        gone = state == "absent" and names is not None and self.cfg.name not in names
        cleanup = {
            "name": self.cfg.name,
            "project": self.cfg.project,
            "zone": self.cfg.zone,
            "delete_rc": call.rc,
            "already_gone": already_gone,
            "describe": state,
            "list_rc": listed.rc,
            "listed_names": names,
            "verified_gone": gone,
            "checked_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.write_record("cleanup.json", cleanup)
        if not gone:
            if not call.ok and not already_gone:
                why = f"delete exited {call.rc} ({call.tail()})"
            else:  # name only the checks that failed
                problems = [
                    _describe_problem(state, described),
                    _list_problem(listed, names, self.cfg.name),
                ]
                why = "after delete, " + " and ".join(p for p in problems if p)
            raise self.not_verified(why)
        return cleanup

    def not_verified(self, why: str) -> DeleteError:
        return DeleteError(
            f"DELETE NOT VERIFIED: {self.resource()} may still exist and cost money: {why}. "
            f"Delete it by hand: {shlex.join(delete_argv(self.cfg))}"
        )


def _describe_problem(state: str, call: Call) -> str | None:
    """What a describe result says against 'the VM is gone' (None: it says NOT_FOUND)."""
    if state == "absent":
        return None
    if state == "malformed":
        return f"describe says 'malformed' (exit 0, no JSON object: {call.stdout.strip()[:80]!r})"
    if state == "present":
        return "describe says 'present'"
    return f"describe says {state!r} (exit {call.rc}: {call.tail()})"


def _list_problem(call: Call, names: list[str] | None, name: str) -> str | None:
    if not call.ok:
        return f"list failed (exit {call.rc}: {call.tail()})"
    if names is None:
        return f"list returned no JSON list ({call.stdout.strip()[:80]!r})"
    return "list still shows it" if name in names else None


def _listed_names(stdout: str) -> list[str] | None:
    try:
        nodes = json.loads(stdout or "[]")
    except ValueError:
        return None
    if not isinstance(nodes, list):
        return None
    return [str(n.get("name", "")).rsplit("/", 1)[-1] for n in nodes if isinstance(n, dict)]


def verify_fetched(run_dir: Path, worker: int) -> dict:
    """Every checkpoint under the retrieved run dir must match its own manifest here, locally."""
    checkpoints = []
    for manifest in sorted(run_dir.rglob(MANIFEST)):
        ckpt = manifest.parent
        try:
            verify_manifest(ckpt)
            checkpoints.append(
                {
                    "path": str(ckpt.relative_to(run_dir)),
                    "verified": True,
                    "manifest_sha256": manifest_digest(ckpt),
                }
            )
        except TpulabError as e:
            checkpoints.append(
                {"path": str(ckpt.relative_to(run_dir)), "verified": False, "error": str(e)}
            )
    records = read_records(RunDir(run_dir).metrics)
    starts = [r for r in records if r.get("event") == "start"]
    preempted = [r for r in records if r.get("event") == "preempted"]
    return {
        "worker": worker,
        "run_dir": str(run_dir),
        "checkpoints": checkpoints,
        "segments": len(starts),
        "resumed_from": [s.get("resumed_from") for s in starts],
        "preempted_at": [r["step"] for r in preempted],
        "final_step": max((r["step"] for r in records if "step" in r), default=None),
    }
