"""What runs on the TPU VM's workers: the job's command line, its staged paths and environment.

A ``JobSpec`` is checked where it is made (a bad run name, a missing config or data file, a
placeholder without its file: one line, before any gcloud call).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from tpulab.checkpoint.rundir import CONFIG
from tpulab.cloud.worker import PREEMPT_RECORD
from tpulab.errors import TpulabError

DEFAULT_JOB = (
    "train --run-dir {run_dir} --no-progress"  # plus --config {config} / --data {data} when staged
)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What runs on the workers. ``job`` is any tpulab command line (without ``tpulab``); the
    placeholders {run_dir}, {config} and {data} become the staged paths on the worker."""

    config: Path | None = None
    data: Path | None = None
    job: str | None = None  # None: DEFAULT_JOB with the staged config and data
    run_name: str = "run"
    env: dict = dataclasses.field(default_factory=dict)
    worker_env: dict = dataclasses.field(default_factory=dict)  # worker index -> {VAR: value}

    def __post_init__(self):
        if not self.run_name or "/" in self.run_name or self.run_name.startswith("."):
            raise TpulabError(f"run name {self.run_name!r} must be a plain directory name")
        for path, what in ((self.config, "config"), (self.data, "data")):
            if path is not None and not Path(path).exists():
                raise TpulabError(f"{what} not found: {path}")
        if self.job is None:
            job = (
                DEFAULT_JOB
                + (" --config {config}" if self.config else "")
                + (" --data {data}" if self.data else "")
            )
            object.__setattr__(self, "job", job)
        if "{config}" in self.job and self.config is None:
            raise TpulabError("the job uses {config} but no --config was given")
        if "{data}" in self.job and self.data is None:
            raise TpulabError("the job uses {data} but no --data was given")

    def local_run_dir(self) -> str:
        """``runs/NAME`` on each worker's own disk (in remote_dir): receipts, rehearsal records."""
        return f"runs/{self.run_name}"

    def remote_run_dir(self, shared_dir: str | None = None) -> str:
        """The job's ``{run_dir}``: ``SHARED/runs/NAME``, one directory that every process of a
        multi-host job sees (Orbax writes one checkpoint from all processes), or without a shared
        dir each worker's own."""
        return (
            f"{shared_dir.rstrip('/')}/runs/{self.run_name}" if shared_dir else self.local_run_dir()
        )

    def job_args(self, shared_dir: str | None = None) -> list[str]:
        values = {
            "{run_dir}": self.remote_run_dir(shared_dir),
            "{config}": f"stage/{CONFIG}",
            "{data}": f"stage/data/{Path(self.data).name}" if self.data else "",
        }
        try:
            tokens = shlex.split(self.job)
        except ValueError as e:
            raise TpulabError(f"cannot parse the job command {self.job!r}: {e}") from None
        if tokens and tokens[0] == "tpulab":
            tokens = tokens[1:]
        if not tokens:
            raise TpulabError("the job command is empty")
        out = []
        for t in tokens:
            for k, v in values.items():
                t = t.replace(k, v)
            out.append(t)
        return out

    def rehearsal_args(self, shared_dir: str | None, preempt_at: int) -> list[str]:
        """The job wrapped in ``tpu worker-job``: preempted at step ``preempt_at``, the event
        recorded in the worker's own run dir."""
        return [
            "tpu",
            "worker-job",
            "--run-dir",
            self.remote_run_dir(shared_dir),
            "--preempt-at",
            str(preempt_at),
            "--record",
            f"{self.local_run_dir()}/{PREEMPT_RECORD}",
            "--",
            *self.job_args(shared_dir),
        ]


def env_prefix(env: dict) -> str:
    """``env A=1 B=2 `` before a worker's command (nothing for no variables), each quoted."""
    return ("env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " ") if env else ""
