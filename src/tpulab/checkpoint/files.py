"""Durable files: atomic writes, sha256 manifests, and the one check of a command's ``--out``.

A file is written to a temporary sibling, fsynced, then renamed over its target, so a reader sees
either the old file or the whole new one. A manifest lists the sha256 and size of every file under
a directory; it is written last and is the directory's completion marker: no manifest, or a
mismatch, means the directory is not a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from tpulab.errors import CheckpointError, TpulabError

MANIFEST = "tpulab_manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _listed_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: str | Path, extra: dict | None = None) -> dict:
    """Hash every file under ``root`` and write the manifest atomically; returns it."""
    root = Path(root)
    files = {
        str(p.relative_to(root)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in _listed_files(root)
    }
    manifest = {"format": 1, "files": files, **(extra or {})}
    atomic_write_json(root / MANIFEST, manifest)
    return manifest


def manifest_digest(root: str | Path) -> str:
    """sha256 of the manifest file itself: one hash that names the whole checkpoint."""
    return sha256_file(Path(root) / MANIFEST)


def verify_manifest(root: str | Path) -> dict:
    """Raise CheckpointError naming the first problem; return the manifest if every file matches."""
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{root} has no {MANIFEST} (incomplete or foreign checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{mpath} is not a valid manifest") from None
    present = {str(p.relative_to(root)) for p in _listed_files(root)}
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(f"{root}: file {missing[0]} listed in the manifest is missing")
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointError(f"{root}: file {extra[0]} is not in the manifest")
    for rel, info in files.items():
        if sha256_file(root / rel) != info["sha256"]:
            raise CheckpointError(f"{root}: checksum mismatch in {rel} (corrupt checkpoint)")
    return manifest


def check_out(
    out: str | Path,
    flag: str = "--out",
    *,
    file: bool = False,
    reuse: Callable[[Path], bool] | None = None,
) -> Path:
    """``out`` as a Path, for a command to write: absent or, for a directory, empty. Anything else
    is refused in one line naming the first entry in the way, so no user's file is overwritten,
    unless ``reuse(out)`` says it holds this command's own earlier result (each caller documents
    and tests why that one may be reused). The one check of every command's ``--out``."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return out
    if out.is_dir() and not file:
        entries = sorted(out.iterdir())
        if not entries or (reuse is not None and reuse(out)):
            return out
        raise TpulabError(
            f"{flag} {out} already exists and is not empty ({entries[0].name} is in the way); "
            "choose a new or empty directory"
        )
    if reuse is not None and reuse(out):
        return out
    what = "a directory" if out.is_dir() else "a file"
    raise TpulabError(
        f"{flag} {out} already exists ({what}) and is never overwritten; choose a new path"
    )


def holds_only(*names: str) -> Callable[[Path], bool]:
    """A ``reuse`` for ``check_out``: the directory holds nothing but files of these names (a
    report command's own earlier report, which it rewrites whole)."""
    return lambda out: all(p.is_file() and p.name in names for p in out.iterdir())


def json_with(*keys: str) -> Callable[[Path], bool]:
    """A ``reuse`` for ``check_out(file=True)``: the file is a JSON object holding these keys (a
    command's own earlier record, which it replaces)."""

    def reuse(out: Path) -> bool:
        try:
            record = json.loads(out.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(record, dict) and all(k in record for k in keys)

    return reuse
