"""The layers of the service's OCI image: what a layer holds (``Layer``) and its reproducible blob.

Reproducible: entries sorted, parents first, mtime 0, uid/gid 0, no user names, modes normalized
(0755 directories and executables, 0644 the rest), PAX tar, gzip with mtime 0 and no file name;
blobs named by their sha256. Existing ``.pyc`` files that are fresh for their source are kept
with their header rewritten to an unchecked-hash pyc (PEP 552: no source mtime in it), so the
normalized mtimes do not make Python recompile at start (cold import of the service: 3.6 s with
them, 10.4 s without, on this host).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import io
import os
import sys
import tarfile
from pathlib import Path

from tpulab.errors import TpulabError

GZIP_LEVEL = 1  # libjax_common.so (334 MB): level 1 96.4 MB in 14 s, level 6 84.3 MB in 42 s
CHUNK = 1 << 20


@dataclasses.dataclass
class Entry:
    """One tar member: a directory, a file (from ``src`` or ``data``) or a symlink."""

    kind: str  # "dir" | "file" | "link"
    mode: int = 0o755
    src: Path | None = None
    data: bytes | None = None
    link: str = ""
    sha256: str | None = None  # a file that must have this digest as it is written


@dataclasses.dataclass
class Layer:
    name: str
    entries: dict[str, Entry] = dataclasses.field(default_factory=dict)

    def add_file(self, path: str, src: Path | None = None, *, data: bytes | None = None, **kw):
        mode = kw.pop("mode", None)
        if mode is None:
            mode = 0o755 if src is not None and os.stat(src).st_mode & 0o111 else 0o644
        self._parents(path)
        self.entries[path] = Entry("file", mode, src=src, data=data, **kw)

    def add_dir(self, path: str, mode: int = 0o755):
        self._parents(path)
        self.entries.setdefault(path, Entry("dir", mode))

    def add_link(self, path: str, target: str):
        self._parents(path)
        self.entries[path] = Entry("link", 0o777, link=target)

    def _parents(self, path: str):
        if path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")):
            raise TpulabError(f"refusing the image path {path!r} (absolute or not normalized)")
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self.entries.setdefault("/".join(parts[:i]), Entry("dir"))


def fresh_pyc(py: Path) -> bytes | None:
    """The cached bytecode of ``py`` as an unchecked-hash pyc, or None if there is none fresh.

    A timestamp pyc records its source's mtime and size; one that still matches is the compile of
    these bytes, so only its 16-byte header changes (flags 0b01 and the source hash, PEP 552).
    """
    pyc = py.parent / "__pycache__" / f"{py.stem}.{sys.implementation.cache_tag}.pyc"
    try:
        data, st = pyc.read_bytes(), py.stat()
    except OSError:
        return None
    magic = importlib.util.MAGIC_NUMBER
    if len(data) < 16 or data[:4] != magic or int.from_bytes(data[4:8], "little") != 0:
        return None
    if (
        int.from_bytes(data[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF
        or int.from_bytes(data[12:16], "little") != st.st_size & 0xFFFFFFFF
    ):
        return None
    header = magic + (1).to_bytes(4, "little") + importlib.util.source_hash(py.read_bytes())
    return header + data[16:]


def add_python_file(layer: Layer, path: str, src: Path) -> None:
    """``src`` at ``path``, and beside it its fresh pyc (if any) in the image's ``__pycache__``."""
    layer.add_file(path, src)
    if src.suffix == ".py":
        pyc = fresh_pyc(src)
        if pyc is not None:
            cached = (
                f"{path.rsplit('/', 1)[0]}/__pycache__/{src.stem}.{sys.implementation.cache_tag}"
            )
            layer.add_file(f"{cached}.pyc", data=pyc, mode=0o644)


# --- writing ------------------------------------------------------------------------------------


class _Tee(io.RawIOBase):
    """Uncompressed tar bytes in: their sha256 (the diff_id) and gzip (mtime 0) out to ``f``."""

    def __init__(self, f, level: int):
        self.diff = hashlib.sha256()
        self.raw = 0
        self.gz = gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=level)

    def writable(self):
        return True

    def write(self, b):
        self.diff.update(b)
        self.raw += len(b)
        self.gz.write(b)
        return len(b)


class _HashingWriter(io.RawIOBase):
    """Bytes written to ``f`` and hashed on the way: the compressed blob's digest."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        return self.f.write(b)


def check_disjoint(layers: list[Layer]) -> None:
    """Refuse a file in two layers: the later would silently shadow the earlier when unpacked."""
    seen: dict[str, str] = {}
    for layer in layers:
        for path, e in layer.entries.items():
            if e.kind != "dir" and path in seen:
                raise TpulabError(f"{path} is in both the {seen[path]} and the {layer.name} layer")
            if e.kind != "dir":
                seen[path] = layer.name


def write_layer(layer: Layer, directory: Path, level: int = GZIP_LEVEL) -> dict:
    """Write one layer blob into ``directory``; returns its descriptor fields and sizes."""
    tmp = directory / f".{layer.name}.tar.gz.tmp"
    with open(tmp, "wb") as f:
        out = _HashingWriter(f)
        tee = _Tee(out, level)
        with tarfile.open(
            fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=CHUNK
        ) as tar:
            for path in sorted(layer.entries):
                tar.addfile(*_member(path, layer.entries[path]))
        tee.gz.close()
    digest = out.h.hexdigest()
    os.replace(tmp, directory / digest)
    return {
        "name": layer.name,
        "digest": f"sha256:{digest}",
        "size": (directory / digest).stat().st_size,
        "diff_id": f"sha256:{tee.diff.hexdigest()}",
        "uncompressed_size": tee.raw,
        "entries": len(layer.entries),
    }


def _member(path: str, e: Entry):
    info = tarfile.TarInfo(path)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    info.mode = e.mode
    if e.kind == "dir":
        info.type = tarfile.DIRTYPE
        return info, None
    if e.kind == "link":
        info.type, info.linkname = tarfile.SYMTYPE, e.link
        return info, None
    if e.data is not None:
        info.size = len(e.data)
        return info, io.BytesIO(e.data)
    data = _verified_bytes(path, e) if e.sha256 else None
    if data is not None:
        info.size = len(data)
        return info, io.BytesIO(data)
    info.size = os.stat(e.src).st_size
    return info, _SizedFile(e.src, info.size)


def _verified_bytes(path: str, e: Entry) -> bytes:
    data = e.src.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != e.sha256:
        raise TpulabError(
            f"{e.src} changed after verification (sha256 {got[:12]}, verified {e.sha256[:12]})"
        )
    return data


class _SizedFile(io.RawIOBase):
    """A file opened when tar first reads it and closed at its end (thousands stay unopened)."""

    def __init__(self, path: Path, size: int):
        self.path, self.left, self.f = path, size, None

    def readable(self):
        return True

    def readinto(self, b):
        if self.f is None:
            self.f = open(self.path, "rb")
        n = self.f.readinto(memoryview(b)[: self.left])
        self.left -= n
        if self.left == 0 or n == 0:
            self.f.close()
            if self.left:
                raise TpulabError(f"{self.path} shrank while it was being written")
        return n
