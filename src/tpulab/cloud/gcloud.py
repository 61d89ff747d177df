"""gcloud command lines, built in one place, and a runner that records every call.

The builders are pure functions of the config, so the exact forms tpulab sends can be checked
against the installed gcloud's own parser (tests/test_cloud_gcloud_parser.py) without any network.
The runner appends each call (argv, exit code, duration, output) to ``DIR/cloud/calls.jsonl``
before returning, so the log is complete even when a later step fails.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tpulab.cloud.config import CloudConfig
from tpulab.errors import TpulabError

CALLS = "calls.jsonl"
_KEEP_CHARS = 20000


def _base(cfg: CloudConfig, verb: str) -> list[str]:
    return [cfg.gcloud, "compute", "tpus", "tpu-vm", verb]


def _where(cfg: CloudConfig) -> list[str]:
    return [f"--zone={cfg.zone}", f"--project={cfg.project}"]


def create_argv(cfg: CloudConfig) -> list[str]:
    argv = _base(cfg, "create") + [
        cfg.name,
        *_where(cfg),
        f"--accelerator-type={cfg.accelerator_type}",
        f"--version={cfg.runtime_version}",
    ]
    if cfg.spot:
        argv.append("--spot")
    if cfg.preemptible:
        argv.append("--preemptible")
    return argv + ["--quiet"]


def describe_argv(cfg: CloudConfig) -> list[str]:
    return _base(cfg, "describe") + [cfg.name, *_where(cfg), "--format=json"]


def list_argv(cfg: CloudConfig) -> list[str]:
    return _base(cfg, "list") + [*_where(cfg), "--format=json"]


def delete_argv(cfg: CloudConfig) -> list[str]:
    return _base(cfg, "delete") + [cfg.name, *_where(cfg), "--quiet"]


def _worker(worker: int | str) -> str:
    return f"--worker={worker}"


# Non-interactive: --quiet (no prompts, a new ssh key without passphrase) and no host-key prompt
# for a VM that was created seconds ago.
_BATCH = ["--strict-host-key-checking=no", "--quiet"]


def ssh_argv(cfg: CloudConfig, command: str, worker: int | str = "all") -> list[str]:
    return _base(cfg, "ssh") + [
        cfg.name,
        *_where(cfg),
        _worker(worker),
        f"--command={command}",
        *_BATCH,
    ]


def scp_to_argv(
    cfg: CloudConfig, local: list[str], remote: str, worker: int | str = "all"
) -> list[str]:
    return _base(cfg, "scp") + [
        *local,
        f"{cfg.name}:{remote}",
        *_where(cfg),
        _worker(worker),
        "--recurse",
        *_BATCH,
    ]


def scp_from_argv(cfg: CloudConfig, remote: str, local: str, worker: int | str) -> list[str]:
    return _base(cfg, "scp") + [
        f"{cfg.name}:{remote}",
        local,
        *_where(cfg),
        _worker(worker),
        "--recurse",
        *_BATCH,
    ]


def command_forms(cfg: CloudConfig) -> dict[str, list[str]]:
    """Every command form tpulab sends, with placeholder operands; the parser test runs these."""
    return {
        "create": create_argv(cfg),
        "describe": describe_argv(cfg),
        "list": list_argv(cfg),
        "scp to --worker=all": scp_to_argv(
            cfg, ["/tmp/tpulab-x.whl", "/tmp/config.yaml"], "tpulab/"
        ),
        "scp from --worker=N": scp_from_argv(cfg, "tpulab/runs/r", "/tmp/out/", 1),
        "scp from --worker=N, absolute (shared dir)": scp_from_argv(
            cfg, "/mnt/shared/runs/r", "/tmp/out/", 0
        ),
        "ssh --worker=all --command": ssh_argv(
            cfg, "cd tpulab && .venv/bin/tpulab receipt --out runs/r/receipt"
        ),
        "ssh --worker=N --command": ssh_argv(
            cfg, "cd tpulab && env A=1 .venv/bin/tpulab train", worker=0
        ),
        "delete --quiet": delete_argv(cfg),
    }


@dataclass
class Call:
    step: str
    argv: list[str]
    rc: int
    duration_s: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def tail(self) -> str:
        """The last line of output, for a one-line error."""
        lines = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return lines[-1] if lines else "(no output)"


class Gcloud:
    """Runs gcloud argv lists and appends each call to ``calls_dir/calls.jsonl`` (thread-safe)."""

    def __init__(self, calls_dir: str | Path, env: dict | None = None, echo=None):
        self.dir = Path(calls_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / CALLS
        self.env = env
        self.echo = echo
        self._lock = threading.Lock()

    def __call__(self, step: str, argv: list[str], timeout_s: float) -> Call:
        started = time.time()
        t0 = time.monotonic()
        if self.echo:
            self.echo(f"[{step}] {shlex.join(argv)}")
        try:
            # own process group: a timeout kills gcloud and the ssh/scp it started, not just gcloud
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
                env=self.env if self.env is not None else os.environ.copy(),
            )
        except FileNotFoundError:
            raise TpulabError(
                f"gcloud executable not found: {argv[0]} (install the Google Cloud CLI or set "
                "cloud.gcloud)"
            ) from None
        try:
            out, err = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
        except BaseException as e:  # timeout or Ctrl-C: reap the whole group, record what we have
            _kill_group(proc)
            out, err = proc.communicate()
            rc = 124 if isinstance(e, subprocess.TimeoutExpired) else 130
            err += (
                f"\ntpulab: {'timed out after %.0f s' % timeout_s if rc == 124 else 'interrupted'}"
            )
            if rc == 130:
                self._record(step, argv, rc, started, t0, out, err)
                raise
        return self._record(step, argv, rc, started, t0, out, err)

    def _record(self, step, argv, rc, started, t0, out, err) -> Call:
        call = Call(step, list(argv), rc, round(time.monotonic() - t0, 3), out, err)
        record = {
            "step": step,
            "argv": call.argv,
            "command": shlex.join(call.argv),
            "rc": rc,
            "duration_s": call.duration_s,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "stdout": out[-_KEEP_CHARS:],
            "stderr": err[-_KEEP_CHARS:],
        }
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return call


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_calls(calls_dir: str | Path) -> list[dict]:
    path = Path(calls_dir) / CALLS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
