"""The operations quick start run as written, and one verification for every consumer of a
registered version.

The quick start is parsed from docs/operations.md (the indented block before "## The registry")
and every line of it is run: the ``tpulab`` commands through the CLI's ``main`` in this process,
``serve`` as its own process, ``curl`` as the real program against it on loopback. The only change
is the port (8000 in the doc, a free one here). So the doc and the test cannot drift.

A registered version's ``verification.json`` damaged after registration (missing, not JSON, one
digest byte flipped) is refused by ``registry promote``, ``registry rollback``, ``serve`` and
``image build`` alike, in one line (naming the file, or "not verified" when it is gone), with the
alias and the ledger unchanged, and the service ends at once instead of at its ready timeout; the
undamaged record passes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import REPO, copy_registry_store, registry_cli, run_main, verified_export
from test_serve import WARM_CACHE_ENV, free_port, reap, wait_ready

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "operations.md"
DOC_PORT = "8000"
READY_TIMEOUT_S = 600  # serve's default: a permanent failure must end far sooner


def quickstart() -> list[str]:
    """The quick start's command lines: the indented block of docs/operations.md's first part."""
    head = DOC.read_text().split("\n## The registry")[0]
    return [line[4:] for line in head.splitlines() if line.startswith("    ") and line.strip()]


def _label(argv: list[str]) -> str:
    if argv[0] != "tpulab":
        return argv[0]
    return " ".join(argv[1:3]) if argv[1] == "registry" else argv[1]


def _serve(argv: list[str], cwd, log):
    return subprocess.Popen(
        [sys.executable, "-m", "tpulab.cli", *argv[1:]],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **WARM_CACHE_ENV},
    )


def test_the_quick_start_runs_as_written(tmp_path, monkeypatch, capfd):
    """train -> export -> register -> promote -> serve from models:/N@champion -> a real HTTP
    generate answered by v2 -> rollback (the running service follows to v1) -> status."""
    lines = quickstart()
    commands = [shlex.split(line, comments=True) for line in lines]
    assert [_label(c) for c in commands] == [
        "train",
        "export",
        "export",
        "export",  # the shell's: MLFLOW_TRACKING_URI
        "registry register",
        "registry register",
        "registry promote",
        "registry promote",
        "serve",
        "curl",
        "registry rollback",
        "registry status",
    ], lines
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")  # run from a checkout, as a user would
    port, proc, outputs = str(free_port()), None, {}
    base, log_path = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    t0 = time.monotonic()
    try:
        for line, argv in zip(lines, commands):
            if argv[0] == "export":
                name, value = argv[1].split("=", 1)
                monkeypatch.setenv(name, value.replace("$PWD", str(tmp_path)))
            elif argv[0] == "curl":
                argv = [a.replace(f":{DOC_PORT}/", f":{port}/") for a in argv]
                got = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                assert got.returncode == 0, (line, got.stderr)
                outputs["curl"] = json.loads(got.stdout)
            elif argv[1] == "serve":
                assert argv[-1] == "&" and argv.count(DOC_PORT) == 1, line
                argv = [port if a == DOC_PORT else a for a in argv[:-1]]
                with open(log_path, "wb") as log:  # the child keeps its own descriptor
                    proc = _serve(argv, tmp_path, log)
                wait_ready(proc, base, log_path, timeout=600)
            else:
                if argv[1:3] == ["registry", "register"]:
                    art = tmp_path / argv[argv.index("--artifacts") + 1]
                    assert not (art / "verification.json").exists()  # export writes none
                got = run_main(capfd, *argv[1:])
                assert got.returncode == 0, (line, got.stdout[-2000:], got.stderr[-2000:])
                outputs[line] = got.stdout
        elapsed = time.monotonic() - t0
        # The rollback reaches the running service (its alias watcher, every 10 s by default).
        deadline = time.monotonic() + 300
        while httpx.get(f"{base}/v1/model", timeout=10).json()["identity"]["version"] != "1":
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.5)
        after = httpx.post(f"{base}/v1/generate", json={"prompt": "ROMEO:", "max_new": 8})
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc is not None:
            reap(proc)
    print(f"quick start as written: {elapsed:.1f} s to the last command")
    answer = outputs["curl"]
    assert answer["model"]["name"] == "shakespeare" and answer["model"]["version"] == "2", answer
    assert answer["model"]["alias"] == "champion" and isinstance(answer["text"], str)
    assert after.status_code == 200 and after.json()["model"]["version"] == "1", after.text
    assert rc == 0, log_path.read_text()
    status = outputs[lines[-1]]
    assert "champion -> v1" in status, status
    for art in ("runs/a-20", "runs/a-40"):  # register left the record serve reads
        record = json.loads((tmp_path / art / "verification.json").read_text())
        assert record["passed"] and record["checkpoint_source"]["given_by"] == "artifact manifest"
    assert "Traceback" not in log_path.read_text()


# --- One verification: a damaged record is refused by every consumer alike ----------------------


def _flip_digest(rec) -> None:
    raw = bytearray(rec.read_bytes())
    digest = json.loads(raw)["files_sha256"]["weights.npz"].encode()
    raw[raw.index(digest) + 7] ^= 0x01  # still valid JSON: only the recorded digest changes
    rec.write_bytes(bytes(raw))


def _flip_first(rec) -> None:
    raw = bytearray(rec.read_bytes())
    raw[0] ^= 0x01  # "{" -> "z"
    rec.write_bytes(bytes(raw))


DAMAGE = {
    "missing": (lambda rec: rec.unlink(), "not verified (run: tpulab verify-export"),
    "not_json": (_flip_first, "verification.json is not valid JSON"),
    "flipped_digest": (_flip_digest, "verification.json does not record these files' sha256"),
}


def _one_error_line(rc: int, err: str, words: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert words in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_record_is_refused_by_every_consumer_alike(
    damage, registry_flow, trained_run, tmp_path_factory, tmp_path, capfd
):
    """v1 (champion went v1 -> v2) re-pointed at a copy of its artifacts whose verification.json
    was damaged after registration: rollback to it, promote it, serve it (a real process, the
    default 600 s ready timeout) and build an image of it are each refused in one line naming
    the file; the alias, the store and the ledger as they were. Control: the same copy with the
    record put back rolls back and promotes."""
    from test_registry import _repoint, fingerprint

    store = copy_registry_store(registry_flow[0], tmp_path / "store")
    uri = f"sqlite:///{store}/mlruns.db"
    art = tmp_path / "art"
    shutil.copytree(verified_export(trained_run, tmp_path_factory, 20), art)
    intact = (art / "verification.json").read_bytes()
    _repoint(store, "1", art)
    damage_fn, words = DAMAGE[damage]
    damage_fn(art / "verification.json")
    before = fingerprint(store)

    for args in (("rollback", "tiny"), ("promote", "tiny", "1", "--to", "canary")):
        rc, _, err = registry_cli(uri, *args)
        _one_error_line(rc, err, words)
        assert fingerprint(store) == before, args
    got = run_main(capfd, "image", "build", "--artifacts", art, "--out", tmp_path / "image")
    _one_error_line(got.returncode, got.stderr, words)
    assert not (tmp_path / "image").exists()

    log_path = tmp_path / "serve.log"
    argv = ["tpulab", "serve", "--model", "models:/tiny/1", "--tracking-uri", uri]
    argv += ["--port", str(free_port()), "--ready-timeout", str(READY_TIMEOUT_S)]
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = _serve(argv, tmp_path, log)
        try:
            rc = proc.wait(timeout=240)
        finally:
            reap(proc)
        took = time.monotonic() - t0
    out = log_path.read_text().strip()
    errors = [x for x in out.splitlines() if x.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and errors == out.splitlines()[-1:], (rc, out)
    assert errors[0].startswith("error: not ready (models:/tiny/1") and words in errors[0], out
    assert took < 120 < READY_TIMEOUT_S, took  # ended by the failure, not by the timeout
    assert "Traceback" not in out
    print(f"{damage}: serve refused and exited in {took:.1f} s (ready timeout {READY_TIMEOUT_S} s)")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.get_registered_model("tiny").aliases == {"champion": 2}

    # Negative control: the undamaged record passes the same commands on the same copy.
    (art / "verification.json").write_bytes(intact)
    rc, out, err = registry_cli(uri, "rollback", "tiny")
    assert rc == 0 and "champion: v2 -> v1" in out, err
    rc, out, err = registry_cli(uri, "promote", "tiny", "1", "--to", "canary")
    assert rc == 0, err
    assert client.get_registered_model("tiny").aliases == {"champion": 1, "canary": 1}
