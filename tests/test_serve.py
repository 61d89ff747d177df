"""The HTTP service, driven by a real client on loopback; the server process group is always reaped."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def verified_artifacts(trained_run, tmp_path_factory):
    from conftest import run_cli

    out = tmp_path_factory.mktemp("serve") / "art"
    assert run_cli("export", "--run-dir", str(trained_run), "--out", str(out)).returncode == 0
    proc = run_cli("verify-export", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def _start(art, port, log):
    return subprocess.Popen([sys.executable, "-m", "tpulab.cli", "serve", "--artifacts", str(art), "--host",
                             "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=os.environ.copy())


def _reap(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(verified_artifacts, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve-log") / "server.log"
    with open(log_path, "wb") as log:
        proc = _start(verified_artifacts, port, log)
        try:
            base = f"http://127.0.0.1:{port}"
            seen, deadline = [], time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                try:
                    r = httpx.get(f"{base}/healthz", timeout=5)
                    seen.append(r.status_code)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert seen and seen[-1] == 200, log_path.read_text()
            assert set(seen) <= {200, 503}
            yield base
        finally:
            _reap(proc)


def test_model_identity(server, verified_artifacts):
    from tpulab.checkpoint.files import sha256_file

    body = httpx.get(f"{server}/v1/model", timeout=10).json()
    assert body["manifest_sha256"] == sha256_file(verified_artifacts / "manifest.json")
    assert body["checkpoint_step"] == 40 and set(body["cache_policies"]) == {"fp32", "bf16", "int8"}


def test_generate_is_seeded_and_matches_the_library(server, verified_artifacts):
    from tpulab.inference.export import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_text

    req = {"prompt": "ROMEO:", "max_new": 10, "temperature": 0.9, "top_k": 30, "seed": 11, "cache": "int8"}
    a = httpx.post(f"{server}/v1/generate", json=req, timeout=60)
    b = httpx.post(f"{server}/v1/generate", json=req, timeout=60)
    assert a.status_code == 200, a.text
    assert a.json()["text"] == b.json()["text"]
    engine = open_artifacts(verified_artifacts).engine("int8")
    cfg = SamplingConfig(max_new=10, temperature=0.9, top_k=30, seed=11)
    assert a.json()["text"] == "".join(generate_text(engine, "ROMEO:", cfg))


@pytest.mark.parametrize("body, status, reason", [
    (b"{not json", 422, "json"),
    (b'{"prompt": "' + b"x" * 40 + b'", "max_new": 4}', 422, "exceeds the model's 32 positions"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 422, "at most 4096"),
    (b'{"prompt": "a", "temperature": -1}', 422, "temperature"),
    (b'{"prompt": "a", "top_k": 1000}', 422, "top_k"),
    (b'{"prompt": "a", "max_new": 0}', 422, "max_new"),
    (b'{"prompt": "a", "cache": "fp8"}', 422, "cache"),
    (b'{"prompt": "a", "extra": 1}', 422, "extra"),
    (b'[]', 422, "valid dictionary"),
])
def test_bad_requests_get_4xx_with_reason(server, body, status, reason):
    r = httpx.post(f"{server}/v1/generate", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status and reason.lower() in r.text.lower(), r.text
    assert httpx.get(f"{server}/healthz", timeout=10).status_code == 200


def test_concurrent_requests(server):
    def call(seed):
        r = httpx.post(f"{server}/v1/generate", json={"prompt": "To", "max_new": 8, "seed": seed % 2}, timeout=120)
        return r.status_code, r.json()["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    assert all(code == 200 for code, _ in results)
    assert len({text for i, (_, text) in enumerate(results) if i % 2 == 0}) == 1


def test_refuses_unverified_or_tampered_artifacts(verified_artifacts, tmp_path):
    unverified = tmp_path / "unverified"
    shutil.copytree(verified_artifacts, unverified)
    (unverified / "verification.json").unlink()
    tampered = tmp_path / "tampered"
    shutil.copytree(verified_artifacts, tampered)
    with open(tampered / "weights.npz", "ab") as f:
        f.write(b"\0")
    for art, reason in ((unverified, "not verified"), (tampered, "sha256 mismatch in weights.npz")):
        with open(tmp_path / f"{art.name}.log", "wb") as log:
            proc = _start(art, _free_port(), log)
            try:
                rc = proc.wait(timeout=120)
            finally:
                _reap(proc)
        out = (tmp_path / f"{art.name}.log").read_text().strip()
        assert rc != 0 and reason in out and out.splitlines()[-1].startswith("error: "), out
