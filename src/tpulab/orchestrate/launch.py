"""``tpulab launch``: P local trainer processes on JAX's distributed runtime over loopback.

Each child is ``tpulab <command...>`` with ``TPULAB_COORDINATOR`` (127.0.0.1 and a free port),
``TPULAB_NUM_PROCESSES``, ``TPULAB_PROCESS_ID``, ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=K`` (K host devices each); the trainer joins the
job from that environment (tpulab.train.distributed) and collectives run over gloo. Process 0's
output is the launcher's own; the others write ``<log_dir>/p<i>.log``. ``launch.json`` in the log
dir names the pids, so a proof can kill or stop one process.

Teardown is bounded: the launcher polls every ``POLL_S``; when a process exits non-zero or dies by a
signal, every other one gets SIGCONT and SIGTERM, and SIGKILL after ``grace_s``: nothing outlives
the launcher by more than ``POLL_S + grace_s`` (``+ SETTLE_S`` after a clean error exit; a process
blocked in a collective cannot run its SIGTERM handler, hence the SIGKILL). Children also get
SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG). SIGTERM and SIGINT sent to the launcher are
forwarded to every process (a preemption notice: they agree on a step, save and exit 0). Exit codes
(``tpulab.errors.ExitCode``): ``OK`` when all finished; the common code when every process failed
the same way (bad input: ``BAD_INPUT``); ``STALLED`` when a process's step watchdog fired;
``PEER_FAILED`` when a process died or failed and the rest were torn down.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json
from tpulab.errors import ExitCode, TpulabError
from tpulab.libtpu_env import set_explicitly
from tpulab.proofs.driver import tpulab_argv
from tpulab.train.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

POLL_S = 0.1
GRACE_S = 10.0
SETTLE_S = (
    2.0  # after a clean non-zero exit, the others get this long to exit on their own before SIGTERM
)
LAUNCH_FILE = "launch.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise TpulabError(
                f"coordinator port {port} on 127.0.0.1 is in use "
                "(leave --port out to pick a free one)"
            ) from None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_env(base: dict, *, coordinator: str, processes: int, index: int, devices: int) -> dict:
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", base.get("XLA_FLAGS", "")
    ).strip()
    return set_explicitly(
        base,
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(processes),
            ENV_PROCESS_ID: str(index),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        },
    )


def default_log_dir(command: list[str]) -> Path:
    """``<run dir>/launch`` when the command names one (--run-dir or --out), else a fresh temp
    dir."""
    for flag in ("--run-dir", "--out"):
        if flag in command[:-1]:
            return Path(command[command.index(flag) + 1]) / "launch"
    import tempfile

    return Path(tempfile.mkdtemp(prefix="tpulab-launch-"))


def launch(
    command: list[str],
    *,
    processes: int,
    devices_per_process: int = 1,
    port: int | None = None,
    log_dir: Path | None = None,
    grace_s: float = GRACE_S,
    env: dict | None = None,
) -> int:
    """Run ``tpulab COMMAND`` in ``processes`` processes; returns the job's exit code (see the
    module doc)."""
    if processes < 1:
        raise TpulabError(f"--processes {processes} must be at least 1")
    if devices_per_process < 1:
        raise TpulabError(f"--devices-per-process {devices_per_process} must be at least 1")
    if not command:
        raise TpulabError(
            "nothing to launch: give a command after --, e.g. "
            "tpulab launch --processes 2 -- train ..."
        )
    if port is not None:
        check_port(port)
    port = port or free_port()
    log_dir = Path(log_dir) if log_dir is not None else default_log_dir(command)
    log_dir.mkdir(parents=True, exist_ok=True)
    coordinator = f"127.0.0.1:{port}"
    base = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen] = []
    logs = []
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    t_start = time.monotonic()
    try:
        for i in range(processes):
            out = None
            if i > 0:
                out = open(log_dir / f"p{i}.log", "ab")
                logs.append(out)
            procs.append(
                subprocess.Popen(
                    tpulab_argv(*command),
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    env=child_env(
                        base,
                        coordinator=coordinator,
                        processes=processes,
                        index=i,
                        devices=devices_per_process,
                    ),
                    preexec_fn=_die_with_parent,
                )
            )
        atomic_write_json(
            log_dir / LAUNCH_FILE,
            {
                "coordinator": coordinator,
                "processes": processes,
                "devices_per_process": devices_per_process,
                "command": command,
                "pids": [p.pid for p in procs],
                "launcher_pid": os.getpid(),
                "grace_s": grace_s,
                "poll_s": POLL_S,
            },
        )
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, ExitCode.OK)]
            if failed:
                return _tear_down(procs, failed[0], grace_s, log_dir, t_start)
            if all(c == ExitCode.OK for c in codes):
                return ExitCode.OK
            time.sleep(POLL_S)
    finally:
        for p in procs:  # nothing outlives the launcher, whatever happened above
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        for s, h in old.items():
            signal.signal(s, h)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == ExitCode.STALLED:
        return f"exited with {code} (its step watchdog found the job stalled)"
    return f"exited with {code}"


def _tear_down(
    procs: list[subprocess.Popen],
    first: tuple[int, int],
    grace_s: float,
    log_dir: Path,
    t_start: float,
) -> int:
    index, code = first
    t0 = time.monotonic()
    if (
        code > 0 and code != ExitCode.STALLED
    ):  # a clean error (bad input) usually ends every process alike: let them
        while time.monotonic() < t0 + SETTLE_S and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            for sig in (
                signal.SIGCONT,
                signal.SIGTERM,
            ):  # a stopped process must run to see SIGTERM
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
    deadline = t0 + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    killed = 0
    for p in procs:
        if p.poll() is None:
            p.kill()
            killed += 1
        p.wait()
    codes = [p.returncode for p in procs]
    took = time.monotonic() - t0
    atomic_write_json(
        log_dir / "teardown.json",
        {
            "first_failed_process": index,
            "first_code": code,
            "codes": codes,
            "teardown_s": round(took, 3),
            "sigkilled_after_grace": killed,
            "grace_s": grace_s,
            "job_s": round(time.monotonic() - t_start, 3),
        },
    )
    if all(c == code for c in codes) and code > 0:
        return code  # every process failed alike (bad input): its own code and message
    print(
        f"error: process {index} (pid {procs[index].pid}) {_describe(code)}; tore down the other "
        f"{len(procs) - 1} process(es) in {took:.1f}s ({killed} needed SIGKILL after "
        f"{grace_s:.0f}s; logs in {log_dir})",
        file=sys.stderr,
        flush=True,
    )
    return ExitCode.STALLED if ExitCode.STALLED in codes else ExitCode.PEER_FAILED
