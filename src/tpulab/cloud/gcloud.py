"""gcloud command lines, built in one place, and a runner that records every call.

The builders are pure functions of the config, so the exact forms tpulab sends can be checked
against the installed gcloud's own parser (tests/test_cloud_gcloud_parser.py) without any network.
The executable is ``cloud.gcloud``, resolved once to an absolute path (``resolve_gcloud``), so the
record names the binary that ran. The runner bounds every call by its ``max_timeout_s``
(``cloud.call_timeout_s``), kills each call's whole process group when it times out or the caller
is interrupted (``kill_all`` for calls in other threads), and appends each call (argv, timeout,
exit code, duration, output) to ``DIR/cloud/calls.jsonl`` before returning, so the log is complete
even when a later step fails. ``sigterm_as_interrupt`` delivers SIGTERM like Ctrl-C, so a
supervisor's stop takes the same reaping (and, in ``up``, deleting) path as an interrupt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tpulab.cloud.config import CloudConfig
from tpulab.errors import ExitCode, TpulabError

CALLS = "calls.jsonl"
# The status recorded for a call tpulab killed at its time bound (what coreutils `timeout` exits
# with); a gcloud status, never one tpulab exits with.
TIMED_OUT_RC = 124
_KEEP_CHARS = 20000


def resolve_gcloud(name: str, env: dict | None = None) -> str:
    """The absolute path of the gcloud executable ``name`` (a path, or looked up on the PATH of
    ``env``, default this process's); a one-line error when there is none."""
    found = shutil.which(name, path=(os.environ if env is None else env).get("PATH"))
    if found is None:
        raise TpulabError(
            f"gcloud executable not found: {name} (install the Google Cloud CLI or set "
            "cloud.gcloud)"
        )
    return os.path.abspath(found)


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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so it takes the same reaping path."""


@dataclass
class TermSignals:
    """What ``sigterm_as_interrupt`` saw; while ``deferred`` a SIGTERM is counted, not raised."""

    received: int = 0
    deferred: bool = False

    def handler(self, signum, frame) -> None:
        self.received += 1
        if self.received == 1 and not self.deferred:  # later ones: the stop is under way
            raise Terminated()

    @contextlib.contextmanager
    def defer(self):
        """A SIGTERM in here must not cut short what runs (a delete that stops the billing)."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises ``Terminated`` in the main thread while inside (the handler before is put
    back after). Without it SIGTERM ends the process at once: a gcloud child in its own session
    is orphaned and nothing is deleted. Off the main thread (no handlers there) it does nothing."""
    signals = TermSignals()
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    before = signal.signal(signal.SIGTERM, signals.handler)
    try:
        yield signals
    finally:
        signal.signal(signal.SIGTERM, before)


def interruption(e: BaseException) -> tuple[str, int]:
    """How an interrupt reads in a one-line error, and the exit code it gets."""
    if isinstance(e, Terminated):
        return "terminated (SIGTERM)", ExitCode.TERMINATED
    return "interrupted (SIGINT)", ExitCode.INTERRUPTED


class Gcloud:
    """Runs gcloud argv lists and appends each call to ``calls_dir/calls.jsonl`` (thread-safe).
    Every call's timeout is at most ``max_timeout_s``."""

    def __init__(
        self,
        calls_dir: str | Path,
        env: dict | None = None,
        echo=None,
        max_timeout_s: float | None = None,
    ):
        self.dir = Path(calls_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / CALLS
        self.env = env
        self.echo = echo
        self.max_timeout_s = max_timeout_s
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen] = {}
        self._killed: set[int] = set()

    def kill_all(self) -> None:
        """Kill every call still running (in other threads: theirs return, recorded as killed)."""
        with self._lock:
            running = list(self._running.values())
            self._killed.update(p.pid for p in running)
        for proc in running:
            _kill_group(proc)

    def __call__(self, step: str, argv: list[str], timeout_s: float) -> Call:
        if self.max_timeout_s is not None:
            timeout_s = min(timeout_s, self.max_timeout_s)
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
            with self._lock:
                self._running[proc.pid] = proc
            out, err = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
            if proc.pid in self._killed:
                err += "\ntpulab: killed (the step was interrupted)"
        except BaseException as e:  # timeout, Ctrl-C, SIGTERM: reap the whole group, record it
            _kill_group(proc)
            out, err = proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                rc, why = TIMED_OUT_RC, f"timed out after {timeout_s:.0f} s"
            else:
                why, rc = interruption(e)
            err += f"\ntpulab: {why}"
            if rc != TIMED_OUT_RC:
                self._record(step, argv, rc, started, t0, out, err, timeout_s)
                raise
        finally:
            with self._lock:
                self._running.pop(proc.pid, None)
        return self._record(step, argv, rc, started, t0, out, err, timeout_s)

    def _record(self, step, argv, rc, started, t0, out, err, timeout_s) -> Call:
        call = Call(step, list(argv), rc, round(time.monotonic() - t0, 3), out, err)
        record = {
            "step": step,
            "argv": call.argv,
            "command": shlex.join(call.argv),
            "timeout_s": timeout_s,
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
