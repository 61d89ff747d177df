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


def _start(art, port, log, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpulab.cli",
            "serve",
            "--artifacts",
            str(art),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-batch",
            "4",
            "--batch-window-ms",
            "30",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=os.environ.copy(),
    )


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
    assert body["verification"]["mode"] == "record" and body["verification"]["files_rehashed"] == 10
    assert body["serving"]["max_batch"] == 4 and body["batch_buckets"] == [1, 2, 4]


def test_generate_is_seeded_and_matches_the_library(server, verified_artifacts):
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_text

    req = {
        "prompt": "ROMEO:",
        "max_new": 10,
        "temperature": 0.9,
        "top_k": 30,
        "seed": 11,
        "cache": "int8",
    }
    a = httpx.post(f"{server}/v1/generate", json=req, timeout=60)
    b = httpx.post(f"{server}/v1/generate", json=req, timeout=60)
    assert a.status_code == 200, a.text
    assert a.json()["text"] == b.json()["text"] and a.json()["tokens"] == 10
    engine = open_artifacts(verified_artifacts).engine("int8")
    cfg = SamplingConfig(max_new=10, temperature=0.9, top_k=30, seed=11)
    assert a.json()["text"] == "".join(generate_text(engine, "ROMEO:", cfg))


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"{not json", "json"),
        (b'{"prompt": "' + b"x" * 40 + b'", "max_new": 4}', "exceeds the model's 32 positions"),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', "at most 4096"),
        (b'{"prompt": "a", "temperature": -1}', "temperature"),
        (b'{"prompt": "a", "temperature": 5e-324}', "temperature"),
        (b'{"prompt": "a", "temperature": NaN}', "non-finite number NaN"),
        (b'{"prompt": "a", "temperature": Infinity}', "non-finite number Infinity"),
        (b'{"prompt": "a", "top_k": -Infinity}', "non-finite number -Infinity"),
        (b'{"prompt": "a", "temperature": 1e999}', "1e999"),
        (b'{"prompt": "a", "max_new": 1e999}', "1e999"),
        (b'{"prompt": "a", "seed": NaN}', "NaN"),
        (b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}", "json"),
        (b'{"prompt": "a", "seed": 99999999999999999999}', "seed"),
        (b'{"prompt": "a", "top_k": 1000}', "top_k"),
        (b'{"prompt": "a", "max_new": 0}', "max_new"),
        (b'{"prompt": "a", "max_new": 1.5}', "max_new"),
        (b'{"prompt": "a", "cache": "fp8"}', "cache"),
        (b'{"prompt": "a", "extra": 1}', "extra"),
        (b'{"prompt": ""}', "prompt is empty"),
        (b'{"prompt": 7}', "prompt"),
        (b'{"prompt": "\\ud800"}', "not valid UTF-8"),
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b"[]", "valid dictionary"),
    ],
)
def test_bad_requests_get_422_with_reason(server, body, reason):
    r = httpx.post(
        f"{server}/v1/generate",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 422 and reason.lower() in r.json()["detail"].lower(), r.text
    assert httpx.get(f"{server}/healthz", timeout=10).status_code == 200


def test_concurrent_requests_are_batched_and_get_what_they_would_alone(server, verified_artifacts):
    """8 clients at once, different prompts/lengths/max_new/sampling: batches form, outputs = alone."""
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_ids

    prompts = ["To", "ROMEO: But soft", "a", "KING:", "What light", "O", "Thou art", "Fair"]
    reqs = [
        {
            "prompt": p,
            "max_new": 3 + i,
            "temperature": 0.0 if i % 2 == 0 else 0.9,
            "seed": i,
            "top_k": 20,
        }
        for i, p in enumerate(prompts)
    ]

    def call(req):
        r = httpx.post(f"{server}/v1/generate", json=req, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, reqs))
    assert max(r["batch"] for r in results) > 1, [r["batch"] for r in results]
    engine = open_artifacts(verified_artifacts).engine("fp32")
    for req, got in zip(reqs, results):
        cfg = SamplingConfig(
            max_new=req["max_new"], temperature=req["temperature"], top_k=20, seed=req["seed"]
        )
        want = bytes(t for t in generate_ids(engine, req["prompt"], cfg) if t < 256).decode(
            "utf-8", "replace"
        )
        assert got["text"] == want and got["tokens"] == req["max_new"], (req, got)
    stats = httpx.get(f"{server}/v1/stats", timeout=10).json()
    assert all(
        n <= 3 for n in stats["compiled_variants"].values()
    )  # one executable per bucket (1, 2, 4)


def test_a_slow_client_does_not_hold_up_others(server):
    """A client that sends half a body and stalls: the others are served meanwhile (bodies are read
    before a request is queued, so nothing waits for it)."""
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
        stalled.sendall(
            b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 200\r\n\r\n{"prompt": "slo'
        )
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(
                pool.map(
                    lambda i: (
                        httpx.post(
                            f"{server}/v1/generate",
                            json={"prompt": "To", "max_new": 4, "seed": i},
                            timeout=30,
                        ).status_code
                    ),
                    range(4),
                )
            )
        assert codes == [200] * 4 and time.monotonic() - t0 < 30


def _corrupt(art):
    f = art / "decode_bf16.jaxexport"
    f.write_bytes(f.read_bytes()[:1000])


def _swap(art):
    a, b = art / "generate_fp32.jaxexport", art / "generate_int8.jaxexport"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def _rehash(art):
    import json

    from tpulab.checkpoint.files import sha256_file

    m = json.loads((art / "manifest.json").read_text())
    for e in [*m["artifacts"], m["weights"]]:
        e["sha256"] = sha256_file(art / e["file"])
    (art / "manifest.json").write_text(json.dumps(m))


def test_refuses_unverified_tampered_corrupt_or_swapped_artifacts_before_listening(
    verified_artifacts, tmp_path
):
    cases = {
        "unverified": (lambda a: (a / "verification.json").unlink(), "not verified"),
        "tampered": (
            lambda a: open(a / "weights.npz", "ab").write(b"\0"),
            "sha256 mismatch in weights.npz",
        ),
        "corrupt": (
            lambda a: (_corrupt(a), _rehash(a)),
            "decode_bf16.jaxexport cannot be deserialized",
        ),
        "swapped": (
            lambda a: (_swap(a), _rehash(a)),
            "generate_fp32.jaxexport does not hold a fp32 cache",
        ),
    }
    for name, (damage, reason) in cases.items():
        art = tmp_path / name
        shutil.copytree(verified_artifacts, art)
        damage(art)
        port = _free_port()
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = _start(art, port, log)
            try:
                rc = proc.wait(timeout=120)
            finally:
                _reap(proc)
        out = (tmp_path / f"{name}.log").read_text().strip()
        assert rc != 0 and reason in out and out.splitlines()[-1].startswith("error: "), out
        assert len(out.splitlines()) == 1 and "Traceback" not in out, out


# --- In-process server (real uvicorn on loopback) with the device work slowed by an injected engine ---


class _SlowEngine:
    """Delegates to a real engine after ``delay`` seconds: stands in for long generations."""

    def __init__(self, engine, delay):
        self.engine, self.delay, self.max_len = engine, delay, engine.max_len

    def batch_for(self, n):
        return self.engine.batch_for(n)

    def width_for(self, n):
        return self.engine.width_for(n)

    def compiled_variants(self):
        return self.engine.compiled_variants()

    def generate(self, *args):
        time.sleep(self.delay)
        return self.engine.generate(*args)


@pytest.fixture(scope="module")
def slow_server(verified_artifacts, trained_run):
    import threading

    import uvicorn

    from tpulab.inference.serve import ServeConfig, Service, create_app

    cfg = ServeConfig(
        max_batch=1, batch_window_ms=0, max_queue=3, request_timeout_s=1.0, retry_after_s=2
    )
    service = Service(
        verified_artifacts, cfg, run_dir=trained_run
    )  # re-verified against the checkpoint
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while not service.ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.ready.is_set(), service.warmup_error
        for p, e in service.batcher.engines.items():
            service.batcher.engines[p] = _SlowEngine(e, 0.6)
        yield base, service
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        service.batcher.stop()


def test_run_dir_server_says_it_reverified_against_the_checkpoint(slow_server):
    base, _ = slow_server
    v = httpx.get(f"{base}/v1/model", timeout=10).json()["verification"]
    assert v["mode"] == "checkpoint" and v["weights"] == "bitwise equal to the checkpoint"


def test_overflow_503_time_limit_504_and_healthz_stays_responsive(slow_server):
    base, _ = slow_server
    body = {"prompt": "To", "max_new": 4, "temperature": 0.0}

    def call(_):
        r = httpx.post(f"{base}/v1/generate", json=body, timeout=30)
        return r.status_code, r.headers.get("retry-after"), r.json()

    health = []
    probe = httpx.Client(timeout=10)
    assert probe.get(f"{base}/healthz").status_code == 200  # connection open before the storm
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, i) for i in range(8)]
        while not all(f.done() for f in futures):
            t0 = time.perf_counter()
            r = probe.get(f"{base}/healthz")
            health.append(
                (r.status_code, time.perf_counter() - t0, sum(not f.done() for f in futures))
            )
            time.sleep(0.05)
        results = [f.result() for f in futures]
    probe.close()
    codes = sorted(code for code, _, _ in results)
    assert set(codes) <= {200, 503, 504} and 200 in codes and 503 in codes and 504 in codes, results
    assert all(ra == "2" and "queue full" in b["detail"] for c, ra, b in results if c == 503)
    assert all("time limit of 1 s" in b["detail"] for c, _, b in results if c == 504)
    busy = [h for h in health if h[2] > 0]
    assert len(busy) >= 5 and all(code == 200 for code, _, _ in busy)
    assert max(dt for _, dt, _ in busy) < 0.5, (
        busy
    )  # the device work (0.6 s per batch) never blocks it
    # After the storm (and the batch whose client gave up, which cannot be interrupted) it still serves.
    deadline = time.monotonic() + 10
    while (
        httpx.get(f"{base}/v1/stats", timeout=10).json()["queued"] and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    time.sleep(0.7)
    assert call(0)[0] == 200


def test_failed_warm_up_stops_the_server(verified_artifacts):
    from tpulab.inference.serve import ServeConfig, Service

    service = Service(verified_artifacts, ServeConfig(max_batch=1))

    class Broken:
        max_len = 32

        def batch_for(self, n):
            return n

        def width_for(self, n):
            return 32

        def generate(self, *args):
            raise RuntimeError("device lost")

    stopped = []
    service.engines = {"fp32": Broken()}
    service.on_warmup_failure = lambda: stopped.append(True)
    service.warm_up()
    assert (
        stopped == [True] and not service.ready.is_set() and "device lost" in service.warmup_error
    )
