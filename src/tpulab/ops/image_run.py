"""The image run without a daemon: its unpacked root under bubblewrap, after the layout's check.

Nothing runs before ``verify_layout`` has rehashed every blob and layer diff_id of the layout (the
check ``tpulab image verify`` makes), and the process's user, environment and command come from
the config that check read. The unpacked root is the layout's as ``umoci raw unpack`` wrote it
(umoci checks the digests as it unpacks); the service in it verifies its own artifacts at start.

The stop. bwrap forwards no signal and dies of SIGTERM at once (measured: exit -15 in 0.0 s, the
service still draining inside, its process group alive after): so ``run_image`` does not exec
bwrap; it runs it in a session of its own and forwards SIGTERM/SIGINT to the image's process alone
(the sandbox's init ignores them, as a PID namespace's init does), then exits with that process's
code: a drained stop is 0, as outside the image. ``--die-with-parent`` still ends the sandbox if
this process is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tpulab.errors import TpulabError
from tpulab.ops.image_layout import verify_layout


def bwrap_argv(rootfs: str | Path, config: dict, args: list[str] | None = None) -> list[str]:
    """The bubblewrap command that runs the image's process in an unpacked ``rootfs``.

    Read-only root, fresh /proc, /dev and /tmp, its own user, pid, ipc, uts and mount namespaces,
    the host's network (so a port on loopback reaches it), the image's user, environment and
    working directory; ``args`` replace the image's Cmd (as ``docker run IMAGE ARGS`` does).
    """
    c = config.get("config", {})
    uid, _, gid = str(c.get("User", "0:0")).partition(":")
    argv = ["bwrap", "--ro-bind", str(Path(rootfs).resolve()), "/", "--proc", "/proc"]
    argv += ["--dev", "/dev", "--tmpfs", "/tmp", "--unshare-all", "--share-net"]
    # No --new-session (``run_image`` starts bwrap in a session of its own and forwards the stop
    # signals itself); --die-with-parent leaves no orphan.
    argv += ["--die-with-parent", "--uid", uid, "--gid", gid or uid]
    argv += ["--clearenv"]
    for kv in c.get("Env", []):
        name, _, value = kv.partition("=")
        argv += ["--setenv", name, value]
    argv += ["--chdir", c.get("WorkingDir") or "/"]
    return argv + ["--", *c.get("Entrypoint", []), *(c.get("Cmd", []) if args is None else args)]


def run_image(layout: str | Path, rootfs: str | Path, args: list[str] | None = None) -> int:
    """Verify ``layout``, then run the image's process under bubblewrap (no daemon, no root
    needed where user namespaces are allowed), forwarding SIGTERM and SIGINT to it; returns its
    exit code. ``rootfs``: the layout unpacked, e.g. by ``umoci raw unpack --image LAYOUT:TAG
    ROOTFS``."""
    rootfs = Path(rootfs)
    if not (rootfs / "usr").is_dir():
        raise TpulabError(
            f"{rootfs} is not an unpacked image (unpack it: umoci raw unpack --image "
            f"{layout}:latest {rootfs})"
        )
    config = verify_layout(layout)["config"]  # before anything runs or any tool is needed
    if shutil.which("bwrap") is None:
        raise TpulabError("bwrap is not installed (Debian: apt-get install bubblewrap)")
    argv = bwrap_argv(rootfs, config, args)
    sys.stdout.flush()
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: pending.append(sig)) for s in _FORWARDED}
    try:
        proc = subprocess.Popen(argv, start_new_session=True)
        while (rc := proc.poll()) is None:
            while pending and (targets := _image_processes(proc.pid)):
                sig = pending.pop(0)
                for pid in targets:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N


_FORWARDED = (signal.SIGTERM, signal.SIGINT)


def _image_processes(bwrap_pid: int) -> list[int]:
    """Host pids of the processes bwrap runs: its descendants that are not a PID namespace's init
    (bwrap's own pid 1 there, which a signal from outside without a handler does not reach)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(bwrap_pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((x.split()[1:] for x in status.splitlines() if x.startswith("NSpid:")), [])
        if nspid[-1:] != ["1"]:
            found.append(pid)
    return found
