"""The image run without a daemon: its unpacked root under bubblewrap, after the layout's check.

Nothing runs before ``verify_layout`` has rehashed every blob and layer diff_id of the layout (the
check ``tpulab image verify`` makes), and the process's user, environment and command come from
the config that check read. The unpacked root is the layout's as ``umoci raw unpack`` wrote it
(umoci checks the digests as it unpacks); the service in it verifies its own artifacts at start.
"""

from __future__ import annotations

import os
import shutil
import sys
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
    # No --new-session: the service stays in the caller's process group, so a SIGTERM to the
    # group reaches it (bwrap forwards no signal); --die-with-parent leaves no orphan.
    argv += ["--die-with-parent", "--uid", uid, "--gid", gid or uid]
    argv += ["--clearenv"]
    for kv in c.get("Env", []):
        name, _, value = kv.partition("=")
        argv += ["--setenv", name, value]
    argv += ["--chdir", c.get("WorkingDir") or "/"]
    return argv + ["--", *c.get("Entrypoint", []), *(c.get("Cmd", []) if args is None else args)]


def run_image(layout: str | Path, rootfs: str | Path, args: list[str] | None = None) -> None:
    """Verify ``layout``, then replace this process with the image's process under bubblewrap (no
    daemon, no root needed where user namespaces are allowed). ``rootfs``: the layout unpacked,
    e.g. by ``umoci raw unpack --image LAYOUT:TAG ROOTFS``."""
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
    os.execvp(argv[0], argv)
