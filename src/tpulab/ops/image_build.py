"""An OCI image of the generation service, written without a daemon, a registry or root.

``build_image`` refuses unverified artifacts (``load_recorded``: every file rehashed, a passing
verification record) before it writes anything, then writes an OCI image layout
(``ops.image_layout``) of five layers (``ops.image_layers``: reproducible tar and gzip):

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

Labels carry the digests.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpulab.checkpoint.files import check_out
from tpulab.errors import TpulabError
from tpulab.ops import tags
from tpulab.ops.image_layers import (
    GZIP_LEVEL,
    Layer,
    add_python_file,
    check_disjoint,
    write_layer,
)
from tpulab.ops.image_layout import TAG, TITLE, write_documents

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
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages"}


# --- what goes in -------------------------------------------------------------------------------


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
            add_python_file(layer, f"{dest}/{rel / f}", src)


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
            add_python_file(layer, f"{dest_site}/{f.resolve().relative_to(site)}", f)
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


def _tpulab_version() -> str:
    try:
        return importlib.metadata.version("tpulab")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH
        return "unknown"


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that holds anything (an image is never overwritten), or whose parent is
    missing (before any work)."""
    check_out(out)
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
    if not TAG.fullmatch(tag):
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
    check_disjoint(layers)
    src = art.manifest["source"]
    labels = {
        TITLE: "tpulab generate service",
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
        process = {
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
        }
        config_desc, manifest_desc = write_documents(
            tmp, written, process, tag=tag, title=labels[TITLE]
        )
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
