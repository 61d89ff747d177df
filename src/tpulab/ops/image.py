"""An OCI image of the generation service, written without a daemon, a registry or root.

``build_image`` refuses unverified artifacts (``load_recorded``: every file rehashed, a passing
verification record) before it writes anything, then writes an OCI image layout (``oci-layout``,
``index.json``, ``blobs/sha256/*``) of five layers:

- ``base``: the CPython interpreter this process runs on (its standard library without the test
  suites, Tk, IDLE, ensurepip, lib2to3 and the static library) at ``/usr/local``, and the shared
  libraries that it and every copied extension module load (the ``ldd`` closure, taken from the
  host, merged-``/usr`` layout); ``/etc/passwd``, ``/etc/group``, ``/etc/hosts``, ``/tmp``. No
  shell, no package manager.
- ``jaxlib`` and ``packages``: the distributions of ``SERVE_DISTRIBUTIONS`` from the pinned stack,
  file by file from their RECORD (jaxlib alone: 365 of the 681 MB, so the two compress in
  parallel). torch, libtpu and the trainer's packages are not there (``EXCLUDED``).
- ``app``: the ``tpulab`` package sources. ``model``: the verified artifacts and their manifest at
  ``/srv/model``, each file rehashed as it is written and compared with the verified digest.

Reproducible: entries sorted, parents first, mtime 0, uid/gid 0, no user names, modes normalized
(0755 directories and executables, 0644 the rest), PAX tar, gzip with mtime 0 and no file name;
blobs named by their sha256; JSON with sorted keys. Existing ``.pyc`` files that are fresh for
their source are kept with their header rewritten to an unchecked-hash pyc (PEP 552: no source
mtime in it), so the normalized mtimes do not make Python recompile at start (cold import of the
service: 3.6 s with them, 10.4 s without, on this host). Labels carry the digests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from tpulab.errors import TpulabError
from tpulab.ops import tags

# What ``tpulab serve`` imports: the distributions of a live service's ``sys.modules`` after
# warm-up and one request (traced on the pinned stack), libtpu and setuptools left out.
SERVE_DISTRIBUTIONS = (
    "absl-py",
    "annotated-doc",
    "annotated-types",
    "anyio",
    "charset-normalizer",
    "click",
    "cloudpickle",
    "etils",
    "fastapi",
    "filelock",
    "flatbuffers",
    "flax",
    "h11",
    "idna",
    "jax",
    "jaxlib",
    "ml_dtypes",
    "msgpack",
    "numpy",
    "opentelemetry-api",
    "opt_einsum",
    "optax",
    "prometheus_client",  # /metrics (imported when the service starts)
    "pydantic",
    "pydantic_core",
    "Pygments",
    "PyYAML",
    "rich",
    "scipy",
    "starlette",
    "treescope",
    "typing-inspection",
    "typing_extensions",
    "uvicorn",
    "uvloop",
)
# Declared by a distribution above, never imported by the service: left out on purpose.
DECLARED_UNUSED = {
    "orbax-checkpoint": "flax's checkpointing (the service restores no checkpoint)",
    "tensorstore": "flax's checkpointing (orbax)",
    "markdown-it-py": "rich's Markdown rendering",
}
# Never in the image: training, the PyTorch bridge, TPU compiles, tracking.
EXCLUDED = ("torch", "torchax", "torch_xla", "libtpu", "orbax-checkpoint", "grain", "mlflow-skinny")
JAXLIB = "jaxlib"
PREFIX = "usr/local"  # where the interpreter goes (image paths carry no leading slash)
MODEL_DIR = "srv/model"
PORT = 8000
USER = "65534:65534"  # nobody: the service needs no privilege, every file is world-readable
GZIP_LEVEL = 1  # libjax_common.so (334 MB): level 1 96.4 MB in 14 s, level 6 84.3 MB in 42 s
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages"}
_CHUNK = 1 << 20
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"


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


# --- what goes in -------------------------------------------------------------------------------


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


def _add_python_file(layer: Layer, path: str, src: Path) -> None:
    layer.add_file(path, src)
    if src.suffix == ".py":
        pyc = fresh_pyc(src)
        if pyc is not None:
            cached = (
                f"{path.rsplit('/', 1)[0]}/__pycache__/{src.stem}.{sys.implementation.cache_tag}"
            )
            layer.add_file(f"{cached}.pyc", data=pyc, mode=0o644)


def _stdlib(layer: Layer, stdlib: Path, dest: str) -> None:
    for root, dirs, files in os.walk(stdlib):
        rel = Path(root).relative_to(stdlib)
        dirs[:] = sorted(
            d
            for d in dirs
            if d != "__pycache__"
            and not (rel == Path(".") and (d in _STDLIB_SKIP or d.startswith("config-")))
        )
        for f in sorted(files):
            if f.startswith("_tkinter") or f.endswith((".pyc", ".a", ".exe")):
                continue
            src = Path(root) / f
            if not src.is_file():
                continue
            _add_python_file(layer, f"{dest}/{rel / f}", src)


def distribution_files(name: str) -> tuple[importlib.metadata.Distribution, list[Path]]:
    """The installed distribution and its files inside site-packages (scripts in bin/ left out)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise TpulabError(
            f"{name} is not installed; the image is built from this environment"
        ) from None
    files = []
    for f in dist.files or []:
        if ".." in f.parts or "__pycache__" in f.parts:
            continue
        p = Path(dist.locate_file(f))
        if p.is_file():
            files.append(p)
    return dist, files


def _site_packages(dist: importlib.metadata.Distribution) -> Path:
    return Path(dist.locate_file("")).resolve()


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


_LDD_LINE = re.compile(r"^\s*(?:(\S+) => )?(\S+) \(0x[0-9a-f]+\)$")


def shared_libraries(elves: list[Path]) -> set[Path]:
    """Every shared library (and the loader) these ELF files load, as ldd resolves them here.

    Unresolvable entries ("not found") are left out: a library that cannot be loaded here is not
    loaded by the service here either (e.g. the CUDA plugins' libcuda).
    """
    if shutil.which("ldd") is None:
        raise TpulabError("ldd (glibc) is needed to collect the shared libraries")
    found: set[Path] = set()
    for i in range(0, len(elves), 200):
        batch = [str(p) for p in elves[i : i + 200]]
        proc = subprocess.run(
            ["ldd", *batch], capture_output=True, text=True, env={"LC_ALL": "C", "PATH": "/usr/bin"}
        )
        for line in proc.stdout.splitlines():
            m = _LDD_LINE.match(line)
            if m and m.group(2).startswith("/"):  # ldd may print "x/../../lib.so": normalize
                found.add(Path(os.path.normpath(m.group(2))))
    return found


def _image_path(host: Path, roots: dict[Path, str]) -> str:
    for root, dest in roots.items():
        if host.is_relative_to(root):
            return f"{dest}/{host.relative_to(root)}"
    s = str(host)
    for old, new in (("/lib/", "/usr/lib/"), ("/lib64/", "/usr/lib64/")):
        if s.startswith(old):
            s = new + s[len(old) :]
    return s.lstrip("/")


def collect(artifacts_files: dict[str, tuple[Path, str]], app_src: Path) -> tuple[list, dict]:
    """The five layers and what they hold (``describe``); nothing is written."""
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sys.base_prefix) / "lib" / py
    interpreter = Path(sys._base_executable).resolve()
    dest_lib = f"{PREFIX}/lib/{py}"
    dest_site = f"{dest_lib}/site-packages"

    base, jaxlib, packages = Layer("base"), Layer("jaxlib"), Layer("packages")
    base.add_file(f"{PREFIX}/bin/{py}", interpreter, mode=0o755)
    base.add_link(f"{PREFIX}/bin/python3", py)
    base.add_link(f"{PREFIX}/bin/python", py)
    _stdlib(base, stdlib, dest_lib)
    base.add_dir(dest_site)

    versions, site_roots = {}, set()
    for name in SERVE_DISTRIBUTIONS:
        dist, files = distribution_files(name)
        versions[dist.metadata["Name"]] = dist.version
        site = _site_packages(dist)
        site_roots.add(site)
        layer = jaxlib if name == JAXLIB else packages
        for f in files:
            _add_python_file(layer, f"{dest_site}/{f.resolve().relative_to(site)}", f)
    present = sorted(n for n in EXCLUDED if n.lower() in {v.lower() for v in versions})
    if present:
        raise TpulabError(f"refusing to put {', '.join(present)} in the serving image")

    roots = {Path(sys.base_prefix).resolve(): PREFIX, **{s: dest_site for s in site_roots}}
    elves = [interpreter] + [
        e.src
        for layer in (base, jaxlib, packages)
        for e in layer.entries.values()
        if e.kind == "file" and e.src is not None and ".so" in e.src.name and _is_elf(e.src)
    ]
    libs = sorted(shared_libraries(elves))
    lib_count = 0
    for lib in libs:
        path = _image_path(lib, roots)
        if not any(path in layer.entries for layer in (base, jaxlib, packages)):
            base.add_file(path, lib.resolve(), mode=0o755)
            lib_count += 1
    base.add_link("lib", "usr/lib")
    base.add_link("lib64", "usr/lib64")
    base.add_link("bin", "usr/bin")
    base.add_dir("usr/bin")
    base.add_file(
        "etc/passwd",
        data=b"root:x:0:0:root:/root:/nonexistent\nnobody:x:65534:65534:nobody:/tmp:/nonexistent\n",
    )
    base.add_file("etc/group", data=b"root:x:0:\nnogroup:x:65534:\n")
    base.add_file("etc/hosts", data=b"127.0.0.1 localhost\n::1 localhost\n")
    for d in ("proc", "sys", "dev", "root"):
        base.add_dir(d)
    base.add_dir("tmp", 0o1777)

    app = Layer("app")
    for f in sorted(app_src.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".json"):
            app.add_file(f"{dest_site}/tpulab/{f.relative_to(app_src)}", f, mode=0o644)

    model = Layer("model")
    for name, (src, digest) in sorted(artifacts_files.items()):
        model.add_file(f"{MODEL_DIR}/{name}", src, mode=0o644, sha256=digest)

    layers = [base, jaxlib, packages, app, model]
    describe = {
        "python": f"CPython {platform.python_version()} from {sys.base_prefix}",
        "shared_libraries": lib_count,
        "distributions": versions,
        "excluded": list(EXCLUDED),
    }
    return layers, describe


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


def _check_disjoint(layers: list[Layer]) -> None:
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
            fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=_CHUNK
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


def _blob(directory: Path, obj: dict, media: str) -> dict:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    (directory / digest).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def _tpulab_version() -> str:
    try:
        return importlib.metadata.version("tpulab")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH
        return "unknown"


def _arch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that holds anything, or whose parent is missing (before any work)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TpulabError(
            f"{out} exists and is not an empty directory; an image is never overwritten"
        )
    if not out.parent.is_dir():
        raise TpulabError(f"directory {out.parent} does not exist")


def build_image(
    artifacts: str | Path,
    out: str | Path,
    *,
    tag: str = "latest",
    key_file: str | Path | None = None,
    level: int = GZIP_LEVEL,
) -> dict:
    """Verify ``artifacts``, then write the OCI layout ``out``; returns the build summary."""
    from tpulab.evidence.provenance import git_commit
    from tpulab.inference.artifact_format import ARTIFACT_MANIFEST, VERIFICATION
    from tpulab.inference.trust import load_recorded, read_key

    t0 = time.monotonic()
    out = Path(out)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", tag):
        raise TpulabError(f"tag {tag!r} is not a valid image tag ([A-Za-z0-9_][A-Za-z0-9._-]*)")
    _check_out(out)
    root = Path(artifacts)
    record_before = (root / VERIFICATION).read_bytes() if (root / VERIFICATION).is_file() else b""
    art = load_recorded(root, key=read_key(key_file))  # refuses unverified artifacts: one line
    record = (root / VERIFICATION).read_bytes()
    if record != record_before:
        raise TpulabError(f"{root / VERIFICATION} changed while it was being checked")
    verification_sha = hashlib.sha256(record).hexdigest()
    files = {name: (root / name, digest) for name, digest in art.file_sha256.items()}
    files[ARTIFACT_MANIFEST] = (root / ARTIFACT_MANIFEST, art.manifest_sha256)
    files[VERIFICATION] = (root / VERIFICATION, verification_sha)

    layers, describe = collect(files, Path(__file__).resolve().parents[1])
    _check_disjoint(layers)
    src = art.manifest["source"]
    labels = {
        "org.opencontainers.image.title": "tpulab generate service",
        "org.opencontainers.image.version": _tpulab_version(),
        "org.opencontainers.image.revision": git_commit() or "unknown",
        tags.EXPORT_MANIFEST: art.manifest_sha256,
        tags.CHECKPOINT: src["checkpoint_manifest_sha256"],
        "tpulab.checkpoint_step": str(src["checkpoint_step"]),
        "tpulab.weights_sha256": art.file_sha256[art.manifest["weights"]["file"]],
        "tpulab.verification_sha256": verification_sha,
        "tpulab.verification_mode": art.verification["mode"],
        "tpulab.base": f"{describe['python']} at /{PREFIX}, {describe['shared_libraries']} shared "
        "libraries (ldd closure), no shell",
        "tpulab.distributions": ",".join(f"{k}=={v}" for k, v in describe["distributions"].items()),
        "tpulab.excluded": ",".join(EXCLUDED),
    }

    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        blobs = tmp / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        workers = min(len(layers), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # zlib releases the GIL
            written = list(pool.map(lambda layer: write_layer(layer, blobs, level), layers))
        py = f"python{sys.version_info.major}.{sys.version_info.minor}"
        config = {
            "architecture": _arch(),
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "User": USER,
                "Env": [
                    f"PATH=/{PREFIX}/bin:/usr/bin",
                    "HOME=/tmp",
                    f"LD_LIBRARY_PATH=/{PREFIX}/lib",  # libpython: its RUNPATH is the host's
                    "PYTHONDONTWRITEBYTECODE=1",
                    "PYTHONUNBUFFERED=1",
                    "PYTHONUTF8=1",
                ],
                "Entrypoint": [f"/{PREFIX}/bin/{py}", "-m", "tpulab.cli"],
                "Cmd": [
                    "serve",
                    "--artifacts",
                    f"/{MODEL_DIR}",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    str(PORT),
                ],
                # The root is read-only; /tmp is the one writable place, and serve writes its
                # trace log (./serve_traces.jsonl) to the working directory, whatever the args.
                "WorkingDir": "/tmp",
                "ExposedPorts": {f"{PORT}/tcp": {}},
                "Labels": labels,
            },
            "rootfs": {"type": "layers", "diff_ids": [w["diff_id"] for w in written]},
            "history": [
                {
                    "created": "1970-01-01T00:00:00Z",
                    "created_by": f"tpulab image build: {w['name']}",
                }
                for w in written
            ],
        }
        config_desc = _blob(blobs, config, CONFIG_MEDIA)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA,
            "config": config_desc,
            "layers": [
                {"mediaType": LAYER_MEDIA, "digest": w["digest"], "size": w["size"]}
                for w in written
            ],
            "annotations": {"org.opencontainers.image.title": "tpulab generate service"},
        }
        manifest_desc = _blob(blobs, manifest, MANIFEST_MEDIA)
        index = {
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA,
            "manifests": [
                {
                    **manifest_desc,
                    "platform": {"architecture": _arch(), "os": "linux"},
                    "annotations": {"org.opencontainers.image.ref.name": tag},
                }
            ],
        }
        (tmp / "index.json").write_bytes(json.dumps(index, sort_keys=True, indent=1).encode())
        (tmp / "oci-layout").write_bytes(b'{"imageLayoutVersion":"1.0.0"}')
        if out.exists():
            out.rmdir()  # empty (checked above); the rename below needs it gone
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    compressed = sum(w["size"] for w in written) + config_desc["size"] + manifest_desc["size"]
    unpacked = sum(w["uncompressed_size"] for w in written)
    summary = {
        "layout": str(out.resolve()),
        "tag": tag,
        "manifest_digest": manifest_desc["digest"],
        "config_digest": config_desc["digest"],
        "layers": written,
        "compressed_bytes": compressed,
        "uncompressed_bytes": unpacked,
        "labels": labels,
        "contents": describe,
        "seconds": round(time.monotonic() - t0, 1),
    }
    line = (
        f"built {out} ({tag}): manifest {manifest_desc['digest']}, {len(written)} layers, "
        f"{compressed / 1e6:.0f} MB compressed, {unpacked / 1e6:.0f} MB unpacked, in "
        f"{summary['seconds']:.0f} s; export manifest {art.manifest_sha256[:12]}, checkpoint "
        f"{src['checkpoint_manifest_sha256'][:12]}"
    )
    return {"summary": summary, "line": line}


# --- checking -----------------------------------------------------------------------------------


def _blob_path(layout: Path, desc: dict) -> Path:
    algo, _, hexd = str(desc.get("digest", "")).partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise TpulabError(f"{layout}: descriptor with an unusable digest {desc.get('digest')!r}")
    path = layout / "blobs" / "sha256" / hexd
    if not path.is_file():
        raise TpulabError(f"{layout}: missing blob {hexd[:12]}")
    return path


def _check_blob(layout: Path, desc: dict) -> Path:
    """The blob of ``desc`` after checking its sha256 and size (streamed: layers are 100s of MB)."""
    path = _blob_path(layout, desc)
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    if f"sha256:{h.hexdigest()}" != desc["digest"] or size != desc.get("size"):
        raise TpulabError(
            f"{layout}: blob {desc['digest'][7:19]} does not match its digest or size"
        )
    return path


def _json_blob(layout: Path, desc: dict) -> dict:
    try:
        return json.loads(_check_blob(layout, desc).read_bytes())
    except ValueError:
        raise TpulabError(f"{layout}: blob {desc['digest'][7:19]} is not JSON") from None


def verify_layout(layout: str | Path) -> dict:
    """Rehash every blob an OCI layout references, and every layer's uncompressed diff_id."""
    layout = Path(layout)
    try:
        marker = json.loads((layout / "oci-layout").read_text())
        index = json.loads((layout / "index.json").read_text())
        descs = list(index["manifests"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TpulabError(f"{layout} is not an OCI image layout") from None
    if marker.get("imageLayoutVersion") != "1.0.0" or len(descs) != 1:
        raise TpulabError(f"{layout}: expected one manifest in an OCI 1.0.0 layout")
    manifest = _json_blob(layout, descs[0])
    try:
        config = _json_blob(layout, manifest["config"])
        layers, diff_ids = manifest["layers"], config["rootfs"]["diff_ids"]
    except (KeyError, TypeError):
        raise TpulabError(f"{layout}: the manifest or config lacks required fields") from None
    if len(diff_ids) != len(layers):
        raise TpulabError(f"{layout}: {len(layers)} layers, {len(diff_ids)} diff_ids")
    blobs = {descs[0]["digest"]: descs[0]["size"], manifest["config"]["digest"]: 0}
    for desc, diff in zip(layers, diff_ids):
        h, raw = hashlib.sha256(), 0
        try:
            with gzip.open(_check_blob(layout, desc), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    raw += len(chunk)
        except (OSError, EOFError):
            raise TpulabError(f"{layout}: layer {desc['digest'][7:19]} is not gzip") from None
        if f"sha256:{h.hexdigest()}" != diff:
            raise TpulabError(f"{layout}: layer {desc['digest'][7:19]} does not unpack to {diff}")
        blobs[desc["digest"]] = raw
    blobs[manifest["config"]["digest"]] = manifest["config"]["size"]
    return {"manifest_digest": descs[0]["digest"], "blobs": blobs, "config": config}


def read_config(layout: str | Path) -> dict:
    """The image config of a layout, its manifest and config blobs checked against their digests
    (the layers are not rehashed here: ``verify_layout`` does that)."""
    layout = Path(layout)
    try:
        descs = list(json.loads((layout / "index.json").read_text())["manifests"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TpulabError(f"{layout} is not an OCI image layout") from None
    if len(descs) != 1:
        raise TpulabError(f"{layout}: expected one manifest, found {len(descs)}")
    manifest = _json_blob(layout, descs[0])
    try:
        return _json_blob(layout, manifest["config"])
    except (KeyError, TypeError):
        raise TpulabError(f"{layout}: the manifest names no config") from None


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
    """Replace this process with the image's process under bubblewrap (no daemon, no root needed
    where user namespaces are allowed). ``rootfs``: the layout unpacked, e.g. by
    ``umoci raw unpack --image LAYOUT:TAG ROOTFS``."""
    rootfs = Path(rootfs)
    if not (rootfs / "usr").is_dir():
        raise TpulabError(
            f"{rootfs} is not an unpacked image (unpack it: umoci raw unpack --image "
            f"{layout}:latest {rootfs})"
        )
    if shutil.which("bwrap") is None:
        raise TpulabError("bwrap is not installed (Debian: apt-get install bubblewrap)")
    argv = bwrap_argv(rootfs, read_config(layout), args)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
