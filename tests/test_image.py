"""The OCI image of the service: a deterministic writer, refusals, validation by skopeo and umoci,
and the image run without a daemon (bubblewrap) with its boundary tested over loopback."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import httpx
import pytest

from conftest import run_main, verified_export
from tpulab.ops import tags
from tpulab.ops.image_layers import Layer, fresh_pyc, write_layer

TOOLS = ("skopeo", "umoci", "bwrap")


def umoci_unpack(layout: Path, root: Path, timeout: int) -> subprocess.CompletedProcess:
    """umoci, an independent reader of the layout, unpacks its ``latest`` image into ``root``
    (every blob's digest checked); the caller judges the outcome."""
    return subprocess.run(
        ["umoci", "raw", "unpack", "--image", f"{layout}:latest", str(root)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _need_tools():
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing and os.environ.get("CI"):
        pytest.fail(
            f"{', '.join(missing)} missing in CI (make test installs them: scripts/system-deps)"
        )
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (make test installs them: scripts/system-deps)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the writer, without artifacts -------------------------------------------------------------


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "run").write_text("#!/bin/sh\n")
    (root / "pkg" / "run").chmod(0o775)
    (root / "data.bin").write_bytes(bytes(range(256)) * 300)
    return root


def _layer(root: Path, order=sorted) -> Layer:
    layer = Layer("t")
    for f in order([p for p in root.rglob("*") if p.is_file()]):
        layer.add_file(f"opt/{f.relative_to(root)}", f)
    layer.add_link("opt/link", "pkg/a.py")
    return layer


def test_layer_bytes_depend_on_content_only(tmp_path):
    src = _tree(tmp_path / "src")
    a = write_layer(_layer(src), _mk(tmp_path / "a"))
    # Same content, other mtimes, group-write bits and insertion order: the same blob.
    for f in src.rglob("*"):
        os.utime(f, (1_000_000, 1_000_000))
    (src / "pkg" / "a.py").chmod(0o664)
    b = write_layer(_layer(src, order=lambda xs: sorted(xs, reverse=True)), _mk(tmp_path / "b"))
    assert (a["digest"], a["diff_id"]) == (b["digest"], b["diff_id"])
    blob = (tmp_path / "a" / a["digest"][7:]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == a["digest"][7:] and len(blob) == a["size"]
    assert blob[3] == 0 and blob[4:8] == b"\0\0\0\0"  # gzip: no file name, mtime 0
    raw = gzip.decompress(blob)
    assert f"sha256:{hashlib.sha256(raw).hexdigest()}" == a["diff_id"]
    members = tarfile.open(fileobj=io.BytesIO(raw)).getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[0] == "opt"  # parents first, sorted
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    modes = {m.name: m.mode for m in members}
    assert modes["opt/pkg/run"] == 0o755 and modes["opt/pkg/a.py"] == 0o644
    # Negative control: one changed byte gives another digest.
    (src / "pkg" / "a.py").write_text("A = 2\n")
    c = write_layer(_layer(src), _mk(tmp_path / "c"))
    assert c["digest"] != a["digest"] and c["diff_id"] != a["diff_id"]


def _mk(d: Path) -> Path:
    d.mkdir()
    return d


def test_image_paths_must_be_normalized():
    from tpulab.errors import TpulabError

    for bad in ("/abs", "a/../b", "a//b", "./a"):
        with pytest.raises(TpulabError, match="not normalized"):
            Layer("t").add_file(bad, data=b"")


def test_fresh_pycs_are_kept_as_unchecked_hash_pycs(tmp_path):
    import py_compile

    src = tmp_path / "m.py"
    src.write_text("X = 1\n")
    py_compile.compile(str(src), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    pyc = fresh_pyc(src)
    assert pyc is not None and int.from_bytes(pyc[4:8], "little") == 1  # hash-based, unchecked
    # In a tree with other mtimes the rewritten pyc is used as is (it is not recompiled): a
    # changed source next to it still imports the compiled X = 1.
    tree = tmp_path / "tree"
    (tree / "__pycache__").mkdir(parents=True)
    (tree / "m.py").write_text("X = 2\n")
    (tree / "__pycache__" / f"m.{sys.implementation.cache_tag}.pyc").write_bytes(pyc)
    out = subprocess.run(
        [sys.executable, "-c", "import m; print(m.X)"],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tree)},
    )
    assert out.stdout.strip() == "1", out.stderr
    # Negative control: a stale pyc (the source changed after it was compiled) is not kept.
    time.sleep(1.1)
    src.write_text("X = 3  # changed\n")
    assert fresh_pyc(src) is None


def test_bwrap_command_follows_the_image_config(tmp_path):
    from tpulab.ops.image_run import bwrap_argv

    config = {
        "config": {
            "User": "65534:65534",
            "Env": ["PATH=/usr/local/bin", "A=b=c"],
            "Entrypoint": ["/usr/local/bin/python3.11", "-m", "tpulab.cli"],
            "Cmd": ["serve", "--port", "8000"],
            "WorkingDir": "/srv",
        }
    }
    argv = bwrap_argv(tmp_path, config)
    joined = " ".join(argv)
    assert argv[:4] == ["bwrap", "--ro-bind", str(tmp_path.resolve()), "/"]
    assert "--uid 65534 --gid 65534" in joined and "--share-net" in argv
    assert "--clearenv --setenv PATH /usr/local/bin --setenv A b=c --chdir /srv" in joined
    assert argv[argv.index("--") + 1 :] == [
        "/usr/local/bin/python3.11",
        "-m",
        "tpulab.cli",
        "serve",
        "--port",
        "8000",
    ]
    other = bwrap_argv(tmp_path, config, ["serve", "--port", "9"])
    assert other[other.index("--") + 1 :][-3:] == ["serve", "--port", "9"]


def test_serving_distributions_are_closed_under_their_requirements():
    """Every requirement of a distribution in the image is in the image too, or left out on
    purpose (``DECLARED_UNUSED``, with the reason); nothing of the training stack is in it."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    from tpulab.ops.image_build import DECLARED_UNUSED, EXCLUDED, SERVE_DISTRIBUTIONS

    def norm(n):
        return n.lower().replace("_", "-")

    inside = {norm(n) for n in SERVE_DISTRIBUTIONS}
    gaps = set()
    for name in SERVE_DISTRIBUTIONS:
        for r in md.distribution(name).requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                gaps |= {norm(req.name)} - inside
    assert gaps == {norm(n) for n in DECLARED_UNUSED}, gaps
    assert not inside & {norm(n) for n in EXCLUDED}
    assert not inside & {"torch", "libtpu", "mlflow-skinny", "grain"}


# --- the layout's check, before anything runs ----------------------------------------------------


def _small_layout(root: Path, layers: list[Layer], process: dict, **damage) -> Path:
    """A layout written by the image's own writer (``write_layer``, ``write_documents``);
    ``damage`` replaces fields of the written layers' descriptors before the documents go in."""
    from tpulab.ops.image_layout import write_documents

    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    written = [dict(write_layer(layer, blobs), **damage) for layer in layers]
    write_documents(root, written, process, tag="latest", title="t")
    return root


def _data_layers() -> list[Layer]:
    app, model = Layer("app"), Layer("model")
    app.add_file("usr/bin/app", data=b"#!/nonexistent\n", mode=0o755)
    model.add_file("srv/model/weights.bin", data=bytes(range(256)) * 64)
    return [app, model]


PROCESS = {"User": "65534:65534", "Entrypoint": ["/usr/bin/app"], "Cmd": ["serve"]}


def _blob_kinds(layout: Path) -> dict[str, Path]:
    """Each file of the layout a byte of which a run must refuse, by its kind."""
    from tpulab.ops.image_layout import verify_layout

    r = verify_layout(layout)
    manifest = json.loads((layout / "blobs/sha256" / r["manifest_digest"][7:]).read_bytes())
    blob = layout / "blobs" / "sha256"
    return {
        "index": layout / "index.json",
        "manifest": blob / r["manifest_digest"][7:],
        "config": blob / manifest["config"]["digest"][7:],
        "layer": blob / manifest["layers"][-1]["digest"][7:],  # the model's
    }


def _flipped_copy(layout: Path, dest: Path, rel: Path, at: int | None = None) -> Path:
    """A hard-linked copy of ``layout`` with one byte of ``rel`` flipped (the middle one)."""
    shutil.copytree(layout, dest, copy_function=os.link)
    path = dest / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 1
    path.unlink()
    path.write_bytes(bytes(data))
    return dest


@pytest.fixture
def execs(monkeypatch) -> list:
    """The bwrap process of ``image run`` in this process, recorded instead of started."""
    import tpulab.ops.image_run as image_run

    calls = []

    def fake_popen(argv, **_):
        calls.append(argv)
        raise SystemExit(0)  # where the real run would end with the image process's code

    # image_run's own name only: other code in the process (ctypes' ldconfig) still runs
    monkeypatch.setattr(image_run, "subprocess", types.SimpleNamespace(Popen=fake_popen))
    return calls


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        h.update(str(f.relative_to(root)).encode() + (f.read_bytes() if f.is_file() else b"/"))
    return h.hexdigest()


def test_run_refuses_a_flipped_byte_of_each_blob_kind_before_anything_starts(
    tmp_path, capfd, execs
):
    """``image run`` (and ``image verify``, the same check) on a layout with one flipped byte in
    its index, manifest, config or a layer: one line naming the blob's kind and digest, non-zero,
    nothing exec'd, nothing on disk changed. Needs none of bwrap, umoci, skopeo: the check comes
    first. Negative control: the untampered layout gets past the check to the exec."""
    from test_cli_errors import assert_one_line_error

    good = _small_layout(tmp_path / "good", _data_layers(), PROCESS)
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    kinds = _blob_kinds(good)
    assert set(kinds) == {"index", "manifest", "config", "layer"}
    for kind, path in kinds.items():
        bad = _flipped_copy(good, tmp_path / f"bad-{kind}", path.relative_to(good))
        before = _tree_digest(bad)
        needle = "index.json" if kind == "index" else f"{kind} blob sha256:{path.name}"
        for argv in (
            ("image", "run", "--layout", bad, "--rootfs", rootfs, "--", "serve"),
            ("image", "verify", bad),
        ):
            r = run_main(capfd, *argv)
            assert_one_line_error(r, needle)
        assert execs == [] and _tree_digest(bad) == before, kind
    # Negative control: the same layout untampered passes the check and reaches the exec (or,
    # on a host without bubblewrap, the refusal that comes after the check).
    r = run_main(capfd, "image", "run", "--layout", good, "--rootfs", rootfs, "--", "serve")
    if shutil.which("bwrap") is None:
        assert_one_line_error(r, "bwrap is not installed")
    else:
        assert r.returncode == 0 and execs[0][0] == "bwrap", r.stderr
        assert execs[0][execs[0].index("--") + 1 :] == ["/usr/bin/app", "serve"]


def test_every_byte_of_index_json_is_checked(tmp_path):
    """``index.json`` is the one file of a layout no digest covers: each of its bytes flipped in
    turn is refused (naming index.json), except inside the tag, where a flip that leaves a valid
    tag renames the image; every byte of ``oci-layout`` likewise. The untampered layout passes."""
    from tpulab.errors import TpulabError
    from tpulab.ops.image_layout import verify_layout

    good = _small_layout(tmp_path / "good", _data_layers(), PROCESS)
    verify_layout(good)  # the control
    raw = (good / "index.json").read_bytes()
    tag_at = raw.index(b'"latest"') + 1
    tag_bytes = range(tag_at, tag_at + len("latest"))
    refused = 0
    for name in ("index.json", "oci-layout"):
        size = len((good / name).read_bytes())
        for at in range(size):
            if name == "index.json" and at in tag_bytes:
                continue
            bad = _flipped_copy(good, tmp_path / f"flip-{at}", Path(name), at)
            with pytest.raises(TpulabError, match=re.escape(name)):
                verify_layout(bad)
            shutil.rmtree(bad)
            refused += 1
    assert refused == len(raw) - len("latest") + len((good / "oci-layout").read_bytes())


def test_a_layer_that_does_not_unpack_to_its_diff_id_is_refused(tmp_path, capfd, execs):
    """Every blob matches its digest, but the config names another diff_id for a layer (a
    consistently rehashed lie): refused at ``image run`` naming the layer's blob."""
    from test_cli_errors import assert_one_line_error

    wrong = f"sha256:{'0' * 64}"
    bad = _small_layout(tmp_path / "bad", _data_layers()[:1], PROCESS, diff_id=wrong)
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    r = run_main(capfd, "image", "run", "--layout", bad, "--rootfs", rootfs)
    assert_one_line_error(r, "layer blob sha256:", f"does not unpack to its diff_id {wrong}")
    assert execs == []


def test_run_starts_an_untampered_image_and_refuses_it_tampered(tmp_path):
    """Real processes: a small image of ``/usr/bin/echo`` and the libraries it loads, unpacked
    by umoci, run by ``tpulab image run`` under bubblewrap, prints its arguments; the same layout
    with one byte of its data layer flipped after the unpack (the rootfs untouched) starts
    nothing: exit non-zero, one line naming the layer's blob."""
    _need_tools()
    from tpulab.ops.image_build import shared_libraries

    echo = Path("/usr/bin/echo")
    bin_ = Layer("bin")
    bin_.add_file("usr/bin/echo", echo.resolve(), mode=0o755)
    for lib in shared_libraries([echo]):
        bin_.add_file(lib.as_posix().lstrip("/"), lib.resolve(), mode=0o755)
    for mount_point in ("proc", "dev", "tmp"):  # bwrap mounts onto them in a read-only root
        bin_.add_dir(mount_point)
    layers = [bin_, _data_layers()[1]]
    process = {"User": "65534:65534", "Entrypoint": ["/usr/bin/echo"], "Cmd": ["default"]}
    layout = _small_layout(tmp_path / "oci", layers, process)
    rootfs = tmp_path / "rootfs"
    unpack = umoci_unpack(layout, rootfs, timeout=300)
    assert unpack.returncode == 0, unpack.stderr

    def run(lay):
        cmd = [sys.executable, "-m", "tpulab.cli", "image", "run", "--layout", str(lay)]
        cmd += ["--rootfs", str(rootfs), "--", "hello", "from", "the", "image"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    ok = run(layout)  # the negative control
    assert ok.returncode == 0 and ok.stdout == "hello from the image\n", ok.stderr
    model = _blob_kinds(layout)["layer"]
    bad = _flipped_copy(layout, tmp_path / "bad", model.relative_to(layout))
    r = run(bad)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and "hello" not in r.stdout and len(errors) == 1, r.stderr
    assert f"layer blob sha256:{model.name} does not match its digest" in errors[0], errors


# --- the image from real verified artifacts ------------------------------------------------------


@pytest.fixture(scope="module")
def verified_artifacts(trained_run, tmp_path_factory):
    return verified_export(trained_run, tmp_path_factory, 40)


def _build(art, out, *prefix):
    cmd = [*prefix, sys.executable, "-m", "tpulab.cli", "image", "build"]
    cmd += ["--artifacts", str(art), "--out", str(out), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def image(verified_artifacts, tmp_path_factory):
    _need_tools()
    out = tmp_path_factory.mktemp("image") / "oci"
    return out, _build(verified_artifacts, out)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_build_refuses_unverified_or_tampered_artifacts_and_writes_nothing(
    verified_artifacts, tmp_path, capfd
):
    """The CLI in this process (``run_main``): a refusal is decided before anything is written,
    and no process boundary is under test here (the builds below are real processes)."""
    from test_cli_errors import assert_one_line_error

    cases = {
        "unverified": (lambda a: (a / "verification.json").unlink(), "not verified"),
        "tampered": (
            lambda a: open(a / "weights.npz", "ab").write(b"\0"),
            "sha256 mismatch in weights.npz",
        ),
    }
    for name, (damage, needle) in cases.items():
        art = tmp_path / name
        shutil.copytree(verified_artifacts, art)
        damage(art)
        out = tmp_path / f"{name}-oci"
        r = run_main(capfd, "image", "build", "--artifacts", art, "--out", out)
        assert_one_line_error(r, needle)
        assert not out.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    r = run_main(
        capfd, "image", "build", "--artifacts", verified_artifacts, "--out", tmp_path / "full"
    )
    assert_one_line_error(r, "is not empty (x is in the way)")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_builds_give_the_same_manifest_digest(image, verified_artifacts, tmp_path):
    """The second build runs without any capability (a user namespace: no chown, mknod, mount or
    chroot is possible) from a copy of the artifacts with fresh mtimes: the same bytes."""
    out, first = image
    art = tmp_path / "art-copy"
    art.mkdir()
    for f in verified_artifacts.iterdir():
        shutil.copyfile(f, art / f.name)  # new inodes and mtimes, same bytes
    second = _build(art, tmp_path / "oci2", "unshare", "--user")
    assert second["manifest_digest"] == first["manifest_digest"]
    assert (out / "index.json").read_bytes() == (tmp_path / "oci2" / "index.json").read_bytes()
    assert [w["digest"] for w in second["layers"]] == [w["digest"] for w in first["layers"]]
    # Negative control: the same verification record written with other whitespace (still
    # valid, still verified) changes the model layer, hence the digest.
    rec = art / "verification.json"
    rec.write_text(json.dumps(json.loads(rec.read_text())))
    from tpulab.inference.trust import load_verified
    from tpulab.ops.image_build import collect

    load_verified(art)  # still a verified set
    files = {p.name: (p, hashlib.sha256(p.read_bytes()).hexdigest()) for p in art.iterdir()}
    layers, _ = collect(files, Path(__import__("tpulab").__file__).parent)
    model = write_layer(layers[-1], _mk(tmp_path / "blobs"))
    assert (
        first["layers"][-1]["name"] == "model" and model["digest"] != first["layers"][-1]["digest"]
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_layout_validates_and_labels_carry_the_digests(image, verified_artifacts, tmp_path, capfd):
    from tpulab.checkpoint.files import sha256_file

    out, built = image
    inspect = subprocess.run(
        ["skopeo", "inspect", f"oci:{out}:latest"], capture_output=True, text=True, timeout=120
    )
    assert inspect.returncode == 0, inspect.stderr
    info = json.loads(inspect.stdout)
    assert info["Digest"] == built["manifest_digest"] and info["Os"] == "linux"
    manifest = json.loads((verified_artifacts / "manifest.json").read_text())
    labels = info["Labels"]
    assert labels[tags.EXPORT_MANIFEST] == sha256_file(verified_artifacts / "manifest.json")
    assert labels[tags.CHECKPOINT] == manifest["source"]["checkpoint_manifest_sha256"]
    assert labels["tpulab.weights_sha256"] == sha256_file(verified_artifacts / "weights.npz")
    assert info["Layers"] == [w["digest"] for w in built["layers"]]
    ls = subprocess.run(["umoci", "ls", "--layout", str(out)], capture_output=True, text=True)
    assert ls.returncode == 0 and ls.stdout.split() == ["latest"], ls.stderr
    ok = run_main(capfd, "image", "verify", out)  # in this process: skopeo and umoci are the
    # independent readers; this checks tpulab's own verifier and its refusal
    assert ok.returncode == 0 and built["manifest_digest"] in ok.stdout, ok.stderr
    # Negative control: one flipped byte in the first layer's blob (a hard-linked copy of the
    # layout; the first layer, so that umoci stops before unpacking the others).
    bad = tmp_path / "bad"
    shutil.copytree(out, bad, copy_function=os.link)
    blob = bad / "blobs" / "sha256" / built["layers"][0]["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.unlink()
    blob.write_bytes(bytes(data))
    r = run_main(capfd, "image", "verify", bad)
    assert r.returncode != 0 and "does not match its digest" in r.stderr, r.stderr
    umoci = umoci_unpack(bad, tmp_path / "never", timeout=600)
    err = umoci.stderr.lower()
    assert umoci.returncode != 0 and ("digest" in err or "checksum" in err), err[-500:]


@pytest.fixture(scope="module")
def rootfs(image, tmp_path_factory):
    """The image unpacked by umoci (an independent reader of the layout, digests checked)."""
    out, _ = image
    root = tmp_path_factory.mktemp("rootfs") / "rootfs"
    proc = umoci_unpack(out, root, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return root


def _run_image(layout, root, port, log, *extra):
    args = [
        "serve",
        "--artifacts",
        "/srv/model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "tpulab.cli", "image", "run", "--layout", str(layout)]
        + ["--rootfs", str(root)]
        + ["--", *args, "--max-batch", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _reap(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_nothing_of_the_training_stack_is_in_the_rootfs(rootfs):
    site = rootfs / "usr/local/lib/python3.11/site-packages"
    assert (site / "jax").is_dir() and (site / "tpulab" / "inference" / "serve.py").is_file()
    for absent in ("torch", "libtpu", "torchax", "orbax", "grain", "mlflow", "pip"):
        assert not (site / absent).exists(), absent
    assert not (rootfs / "usr/bin/sh").exists() and not (rootfs / "bin/sh").exists()
    assert sorted(p.name for p in (rootfs / "srv/model").iterdir())[:2] == [
        "decode_bf16.jaxexport",
        "decode_fp32.jaxexport",
    ]


FUZZ_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    -(2**70),
    1e308,
    -0.0,
    5e-324,
    "",
    "x" * 5000,
    "\u00e9\u4e2d\U0001f600",
    [],
    {},
    [1, 2],
    {"a": 1},
]


def _fuzz_bodies(rng: random.Random, n: int) -> list[tuple[str, str, bytes, dict]]:
    base = {"prompt": "ROMEO:", "max_new": 4, "temperature": 0.0}
    fields = ["prompt", "max_new", "temperature", "top_k", "seed", "cache"]
    json_ct = {"content-type": "application/json"}
    out = []
    for i in range(n):
        kind = i % 8
        if kind == 0:  # random bytes
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        elif kind == 1:  # one field of a random type or value
            obj = dict(base, **{rng.choice(fields): rng.choice(FUZZ_VALUES)})
            body = json.dumps(obj).encode()
        elif kind == 2:  # an unknown field
            body = json.dumps(dict(base, **{f"f{rng.randrange(99)}": 1})).encode()
        elif kind == 3:  # nesting deeper than any decoder's stack
            depth = rng.choice([100, 2000, 20000])
            body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 4:  # truncated JSON
            full = json.dumps(base).encode()
            body = full[: rng.randrange(1, len(full))]
        elif kind == 5:  # a valid request with random sampling (answered 200)
            body = json.dumps(
                {
                    "prompt": rng.choice(["To", "ROMEO:", "a"]),
                    "max_new": rng.randrange(1, 8),
                    "temperature": rng.choice([0.0, 0.5, 1.0]),
                    "top_k": rng.randrange(0, 20),
                    "seed": rng.randrange(2**31),
                }
            ).encode()
        elif kind == 6:  # a body over the limit
            body = json.dumps({"prompt": "a" * rng.choice([70_000, 200_000])}).encode()
        else:  # another method or path
            method, path = rng.choice(
                [("GET", "/v1/generate"), ("POST", "/v1/nope"), ("PUT", "/v1/model")]
            )
            out.append((method, path, b"{}", json_ct))
            continue
        out.append(("POST", "/v1/generate", body, json_ct if rng.random() < 0.8 else {}))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_boundary_over_loopback(image, rootfs, verified_artifacts, tmp_path):
    """Live at once (or not listening before verification), ready only after the real warm-up
    inferences, /v1/model reporting the labels' digests, a fuzzed request contract answered 4xx
    with a reason and never 5xx, outputs equal to the library's on the host."""
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_text

    layout, built = image
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "image.log"
    with open(log_path, "wb") as log:
        proc = _run_image(layout, rootfs, port, log)
        try:
            seen, early, deadline = [], [], time.monotonic() + 1200
            probe = "/readyz"
            while time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if not seen:
                        assert httpx.get(f"{base}/livez", timeout=5).status_code == 200
                    r = httpx.get(f"{base}{probe}", timeout=5)
                    seen.append(r.status_code)
                    if r.status_code == 200:
                        break
                    if len(early) < 3:  # a request before ready is refused, never run
                        g = httpx.post(f"{base}/v1/generate", json={"prompt": "a"}, timeout=10)
                        early.append(g.status_code)
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert seen and seen[-1] == 200 and set(seen) <= {200, 503}, (
                seen,
                log_path.read_text(),
            )
            assert set(early) <= {503}, early
            assert seen[0] == 503, seen  # never ready before verification + a real inference
            text = log_path.read_text()
            assert "verified by record" in text and "error" not in text, text

            model = httpx.get(f"{base}/v1/model", timeout=10).json()
            labels = built["labels"]
            assert model["manifest_sha256"] == labels[tags.EXPORT_MANIFEST]
            assert model["checkpoint_manifest_sha256"] == labels[tags.CHECKPOINT]
            assert model["verification"]["mode"] == "record"

            req = {"prompt": "ROMEO:", "max_new": 8, "temperature": 0.9, "top_k": 20, "seed": 5}
            r = httpx.post(f"{base}/v1/generate", json=req, timeout=120)
            assert r.status_code == 200, r.text
            engine = open_artifacts(verified_artifacts).engine("fp32")
            cfg = SamplingConfig(max_new=8, temperature=0.9, top_k=20, seed=5)
            assert r.json()["text"] == "".join(generate_text(engine, "ROMEO:", cfg))

            codes = {}
            with httpx.Client(timeout=60) as client:
                for method, path, body, headers in _fuzz_bodies(random.Random(23), 240):
                    resp = client.request(method, f"{base}{path}", content=body, headers=headers)
                    codes[resp.status_code] = codes.get(resp.status_code, 0) + 1
                    assert resp.status_code < 500, (resp.status_code, body[:80], resp.text[:200])
                    if resp.status_code != 200:
                        assert 400 <= resp.status_code < 500 and resp.json()["detail"], resp.text
            assert codes.get(200, 0) >= 30 and codes.get(422, 0) >= 100, codes
            assert httpx.get(f"{base}{probe}", timeout=10).status_code == 200
        finally:
            _reap(proc)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_tampered_weight_blob_in_the_image_is_refused(image, rootfs, tmp_path):
    """The same image with one byte of weights.npz changed (a hard-linked copy of the rootfs):
    the service is never ready and exits non-zero at once (a permanent failure, not the ready
    timeout) with one line naming the file."""
    layout, _ = image
    bad = tmp_path / "rootfs"
    shutil.copytree(rootfs, bad, symlinks=True, copy_function=os.link)
    weights = bad / "srv/model/weights.npz"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1
    weights.unlink()
    weights.write_bytes(bytes(data))
    port = _free_port()
    log_path = tmp_path / "bad.log"
    with open(log_path, "wb") as log:
        proc = _run_image(layout, bad, port, log, "--ready-timeout", "20")
        try:
            deadline, codes = time.monotonic() + 600, set()
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    codes.add(httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code)
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            rc = proc.wait(timeout=60)
        finally:
            _reap(proc)
    out = log_path.read_text().strip()
    assert rc != 0 and 200 not in codes, (rc, codes, out)
    assert out.splitlines()[-1].startswith("error: ") and "sha256 mismatch in weights.npz" in out
    assert "Traceback" not in out, out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_image_stops_cleanly_while_starting_and_once_ready(image, rootfs, tmp_path):
    """SIGTERM to ``tpulab image run``'s process group, as an orchestrator sends it, while the
    service in the image is starting (it listens, verifies and compiles cold: the image's cache is
    on its tmpfs) and again once it is ready: exit 0 within the 4 s drain bound both times, no
    abort or traceback, nothing of the group left. (bwrap alone dies of the signal at once, exit
    -15, the service still draining inside: ``image_run`` forwards the signal instead.)"""
    from test_serve_ready import stop_problems

    layout, _ = image
    for moment, line in (("starting", "listening on"), ("ready", "ready after")):
        port, log_path = _free_port(), tmp_path / f"{moment}.log"
        with open(log_path, "wb") as log:
            proc = _run_image(layout, rootfs, port, log, "--drain-timeout", "4")
            try:
                deadline = time.monotonic() + 900
                while line not in log_path.read_text():
                    assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.05)
                t0 = time.monotonic()
                os.killpg(proc.pid, signal.SIGTERM)
                rc = proc.wait(timeout=60)
                took = time.monotonic() - t0
                time.sleep(0.2)
            finally:
                _reap(proc)
        out = log_path.read_text()
        assert stop_problems(rc, took, 4.0, out, proc.pid) == [], (moment, rc, took, out)
        assert "stopped (SIGTERM" in out, out
