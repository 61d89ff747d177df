"""The HTTP service, driven by a real client on loopback; every server process group is reaped.

Readiness (never before verification and a real inference; bad artifacts end the server at once),
the request contract, batching, backpressure, metrics, request ids and traces, the SIGTERM drain,
a slow body and a client that leaves mid-body. Registry serving is in test_serve_registry.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import verified_export
from tpulab.data.drift import THRESHOLD
from tpulab.errors import ExitCode

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The CLI caches only compiles over JAX's default 1 s, so a server child skipped the quicker of
# its 9 (3 policies x 3 buckets) and every later server and in-process engine compiled them again.
# Readiness is tested with whatever the cache holds; no test here is about a cold compile (the
# first server of a run, here or in test_serve_registry.py, still compiles cold).
WARM_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def start_server(log, *args, port: int, max_batch: int = 4):
    """``tpulab serve ARGS`` in its own process group, traces beside the log."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpulab.cli",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-batch",
            str(max_batch),
            "--batch-window-ms",
            "30",
            "--trace-log",
            str(Path(log.name).with_suffix(".traces.jsonl")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **WARM_CACHE_ENV},
    )


def reap(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def wait_ready(proc, base: str, log_path: Path, timeout: float = 300) -> list[tuple[int, int]]:
    """Poll /livez and /readyz until ready; returns every (livez, readyz) status pair seen."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        try:
            pair = (httpx.get(f"{base}/livez", timeout=5).status_code,)
            pair += (httpx.get(f"{base}/readyz", timeout=5).status_code,)
            seen.append(pair)
            if pair[1] == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout} s: {seen[-3:]}\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def verified_artifacts(trained_run, tmp_path_factory):
    return verified_export(trained_run, tmp_path_factory, 40)


@pytest.fixture(scope="module")
def server(verified_artifacts, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-log") / "server.log"
    with open(log_path, "wb") as log:
        args = ("--artifacts", str(verified_artifacts), "--cache-policy", "fp32", "int8")
        proc = start_server(log, *args, port=port)
        try:
            base = f"http://127.0.0.1:{port}"
            seen = wait_ready(proc, base, log_path)
            assert set(seen) <= {(200, 200), (200, 503)}, seen  # live whenever it answers
            yield base, log_path
        finally:
            reap(proc)


def _metrics(base: str) -> dict:
    """{(sample name, sorted labels): value} parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _traces(log_path: Path) -> dict:
    lines = log_path.with_suffix(".traces.jsonl").read_text().splitlines()
    return {t["request_id"]: t for t in map(json.loads, lines)}


def test_model_identity(server, verified_artifacts):
    from tpulab.checkpoint.files import sha256_file

    base, _ = server
    body = httpx.get(f"{base}/v1/model", timeout=10).json()
    assert body["manifest_sha256"] == sha256_file(verified_artifacts / "manifest.json")
    assert body["checkpoint_step"] == 40 and set(body["cache_policies"]) == {"fp32", "bf16", "int8"}
    assert body["verification"]["mode"] == "record" and body["verification"]["files_rehashed"] == 10
    assert body["serving"]["max_batch"] == 4 and body["batch_buckets"] == [1, 2, 4]
    assert body["registry"] is None and body["identity"]["checkpoint_step"] == 40
    assert body["drift"]["reference"].startswith("37 training documents of shakespeare")
    ready = httpx.get(f"{base}/readyz", timeout=10).json()
    assert ready["probe"]["tokens"] >= 1 and ready["policies"] == ["fp32", "int8"]
    paths = {f"{p}/{b}" for p, bs in ready["compiled"].items() for b in bs}
    assert 1 in ready["compiled"]["fp32"] and not ready["compile_failed"], ready
    assert paths | set(ready["compiling"]) == {
        f"{p}/{b}" for p in ("fp32", "int8") for b in (1, 2, 4)
    }
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200  # the older name


def test_generate_is_seeded_and_matches_the_library(server, verified_artifacts):
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_text

    base, _ = server
    req = {
        "prompt": "ROMEO:",
        "max_new": 10,
        "temperature": 0.9,
        "top_k": 30,
        "seed": 11,
        "cache": "int8",
    }
    a = httpx.post(f"{base}/v1/generate", json=req, timeout=60)
    b = httpx.post(f"{base}/v1/generate", json=req, timeout=60)
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
        (b'{"prompt": "a", "max_new": 2, "cache": "bf16"}', "'bf16' is not served here"),
        (b'{"prompt": "a", "extra": 1}', "extra"),
        (b'{"prompt": "a", "prompt_version": ""}', "prompt_version"),
        (b'{"prompt": ""}', "prompt is empty"),
        (b'{"prompt": 7}', "prompt"),
        (b'{"prompt": "\\ud800"}', "not valid UTF-8"),
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b"[]", "valid dictionary"),
    ],
)
def test_bad_requests_get_422_with_reason(server, body, reason):
    base, _ = server
    r = httpx.post(
        f"{base}/v1/generate",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 422 and reason.lower() in r.json()["detail"].lower(), r.text
    assert r.json()["request_id"] == r.headers["x-request-id"]
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200


def test_oversized_body_is_413_without_reading_it_all(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/generate", content=b"x" * (64 * 1024 + 1), timeout=30)
    assert r.status_code == 413 and "at most 65536" in r.json()["detail"], r.text


def test_concurrent_requests_are_batched_and_get_what_they_would_alone(server, verified_artifacts):
    """8 clients at once, different prompts/lengths/max_new/sampling: batches form, each output is
    what the request gets alone."""
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_ids

    base, _ = server
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
        r = httpx.post(f"{base}/v1/generate", json=req, timeout=120)
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
    stats = httpx.get(f"{base}/v1/stats", timeout=10).json()
    assert all(n <= 3 for n in stats["compiled_variants"].values())  # one per bucket (1, 2, 4)


def test_a_slow_client_does_not_hold_up_others(server):
    """A client that sends half a body and stalls: the others are served meanwhile (bodies are read
    before a request is queued, so nothing waits for it)."""
    base, _ = server
    port = int(base.rsplit(":", 1)[1])
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
                            f"{base}/v1/generate",
                            json={"prompt": "To", "max_new": 4, "seed": i},
                            timeout=30,
                        ).status_code
                    ),
                    range(4),
                )
            )
        assert codes == [200] * 4 and time.monotonic() - t0 < 30


def test_metrics_parse_and_count_the_requests_made(server):
    base, _ = server
    gen = lambda code: ("tpulab_requests_total", (("code", code), ("path", "/v1/generate")))  # noqa: E731
    before = _metrics(base)
    ok = [
        httpx.post(f"{base}/v1/generate", json={"prompt": "To be", "max_new": n}, timeout=60)
        for n in (3, 5)
    ]
    bad = httpx.post(f"{base}/v1/generate", json={"prompt": "a", "max_new": 0}, timeout=60)
    assert [r.status_code for r in ok] == [200, 200] and bad.status_code == 422
    after = _metrics(base)
    delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    assert delta(gen("200")) == 2 and delta(gen("422")) == 1
    assert delta(("tpulab_request_latency_seconds_count", ())) == 3
    assert delta(("tpulab_tokens_total", (("kind", "generated"),))) == 8
    assert delta(("tpulab_tokens_total", (("kind", "prompt"),))) == 2 * 6  # BOS + "To be"
    assert delta(("tpulab_batch_size_count", ())) == 2
    assert delta(("tpulab_queue_seconds_count", ())) == 2
    assert after[("tpulab_queue_depth", ())] == 0 and after[("tpulab_ready", ())] == 1
    assert after[("tpulab_prompt_drift_threshold", ())] == THRESHOLD
    assert after[("tpulab_prompt_drift_window_bytes", ())] > 0
    assert 0 < after[("tpulab_prompt_drift_jsd", ())] <= 1


def test_every_response_has_a_request_id_and_every_generation_a_trace(server, verified_artifacts):
    from tpulab.checkpoint.files import sha256_file

    base, log_path = server
    given = httpx.post(
        f"{base}/v1/generate",
        json={"prompt": "ROMEO:", "max_new": 6, "prompt_version": "greeting@3"},
        headers={"x-request-id": "client-id.42"},
        timeout=60,
    )
    fresh = httpx.post(
        f"{base}/v1/generate",
        json={"prompt": "ROMEO:", "max_new": 0},
        headers={"x-request-id": "not ok " + "x" * 80},  # not 1-64 of [A-Za-z0-9._:-]: replaced
        timeout=60,
    )
    missing = httpx.get(f"{base}/no/such/path", timeout=10)
    for r in (given, fresh, missing, httpx.get(f"{base}/livez", timeout=10)):
        assert r.json()["request_id"] == r.headers["x-request-id"], r.text
    assert given.headers["x-request-id"] == "client-id.42" and given.status_code == 200
    assert len(fresh.headers["x-request-id"]) == 32 and fresh.status_code == 422
    assert missing.status_code == 404
    assert "x-request-id" in httpx.get(f"{base}/metrics", timeout=10).headers

    traces = _traces(log_path)
    t, body = traces["client-id.42"], given.json()
    assert t["status"] == 200 and t["prompt_version"] == "greeting@3"
    assert t["prompt_sha256"] == hashlib.sha256(b"ROMEO:").hexdigest() == body["prompt_sha256"]
    assert t["output_sha256"] == hashlib.sha256(body["text"].encode()).hexdigest()
    assert t["model"]["manifest_sha256"] == sha256_file(verified_artifacts / "manifest.json")
    assert t["model"] == body["model"] and t["model"]["checkpoint_step"] == 40
    assert (t["prompt_tokens"], t["generated_tokens"]) == (7, 6)
    assert t["queue_ms"] >= 0 and t["compute_ms"] > 0 and t["batch"] >= 1
    bad = traces[fresh.headers["x-request-id"]]
    assert bad["status"] == 422 and "max_new" in bad["detail"]


def _log_clean(text: str) -> None:
    for marker in ("Traceback", "Exception in ASGI", "ERROR"):
        assert marker not in text, text


def test_client_gone_mid_body_leaves_no_traceback(server):
    base, log_path = server
    port = int(base.rsplit(":", 1)[1])
    before = _metrics(base).get(("tpulab_client_disconnects_total", ()), 0)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": "gone'
        )
        time.sleep(0.3)  # the handler is reading the body when the client leaves
    deadline = time.monotonic() + 20
    while _metrics(base).get(("tpulab_client_disconnects_total", ()), 0) == before:
        assert time.monotonic() < deadline, "the disconnect never reached the handler"
        time.sleep(0.1)
    time.sleep(0.3)  # anything uvicorn would log about it has been written
    _log_clean(log_path.read_text())
    gone = [t for t in _traces(log_path).values() if t["status"] == 499]
    assert gone and "disconnected" in gone[-1]["detail"]
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200


def _read_to_close(sock) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def test_sigterm_drains_in_flight_bounds_a_trickling_body_and_exits_0(verified_artifacts, tmp_path):
    """At SIGTERM one request is mid-body (it finishes its body 0.5 s later and must be answered)
    and another client trickles a byte every 0.1 s forever: it is answered 503 at 3 s, a second
    before the 4 s bound, and the process exits 0 (uvicorn alone exits 143), with no traceback in
    its log."""
    port, log_path = free_port(), tmp_path / "drain.log"
    body = json.dumps({"prompt": "ROMEO:", "max_new": 5, "temperature": 0.0}).encode()
    head = (
        b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    with open(log_path, "wb") as log:
        proc = start_server(
            log,
            *("--artifacts", str(verified_artifacts), "--drain-timeout", "4"),
            *("--body-timeout", "60"),  # so only the drain bounds the trickle
            port=port,
            max_batch=1,  # the drain is not about batching: 3 compiles, not 9
        )
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", log_path)
            inflight = socket.create_connection(("127.0.0.1", port), timeout=30)
            inflight.sendall(head % len(body) + body[:10])
            trickle = socket.create_connection(("127.0.0.1", port), timeout=30)
            trickle.sendall(head % 10_000 + b'{"prompt": "')
            stop = threading.Event()

            def drip():
                while not stop.wait(0.1):
                    try:
                        trickle.sendall(b"x")
                    except OSError:
                        return

            dripper = threading.Thread(target=drip, daemon=True)
            dripper.start()
            time.sleep(0.5)  # both handlers are reading their bodies
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.5)
            inflight.sendall(body[10:])
            answer = _read_to_close(inflight)
            rc = proc.wait(timeout=30)
            stopped_after = time.monotonic() - t0
            stop.set()
            cut = _read_to_close(trickle)
        finally:
            reap(proc)
    out = log_path.read_text()
    assert rc == 0, out
    assert answer.startswith(b"HTTP/1.1 200") and b'"tokens":5' in answer, answer
    assert cut.startswith(b"HTTP/1.1 503") and b"server stopping" in cut, cut
    # cut 1 s before the bound (half a second to write it, half to leave), not held by the trickle
    assert 2.7 < stopped_after < 4 + 1, stopped_after
    assert "stopped (SIGTERM, ready): 1 request(s) answered and 1 cut at the bound" in out, out
    _log_clean(out)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2)


def _corrupt(art):
    f = art / "decode_bf16.jaxexport"
    f.write_bytes(f.read_bytes()[:1000])


def _swap(art):
    a, b = art / "generate_fp32.jaxexport", art / "generate_int8.jaxexport"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def _rehash(art):
    from tpulab.checkpoint.files import sha256_file

    m = json.loads((art / "manifest.json").read_text())
    for e in [*m["artifacts"], m["weights"]]:
        e["sha256"] = sha256_file(art / e["file"])
    (art / "manifest.json").write_text(json.dumps(m))


BAD_ARTIFACTS = {
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


def _damaged(verified_artifacts, tmp_path, name) -> Path:
    art = tmp_path / name
    shutil.copytree(verified_artifacts, art)
    BAD_ARTIFACTS[name][0](art)
    return art


def test_bad_artifacts_end_the_server_at_once_and_a_slow_start_waits_for_the_timeout(
    verified_artifacts, tmp_path
):
    """A permanent failure (unverified, tampered, corrupt or swapped artifacts: nothing would make
    them ready) ends the server at once, exit 1, one line with the reason; only a start still in
    progress waits for the ready timeout (the negative control: a loader held on purpose).

    "corrupt" runs the CLI in a real process with the default 600 s ready timeout: it must end far
    sooner. The other three run serve's own server (``run_server``: real uvicorn on loopback) in
    threads of this process, their ready deadline an injected clock held at 0, so only the failure
    can end them; the held loader's server outlives them, answers /readyz 503 "verifying", and
    ends with "not ready within 20 s" once the clock passes the bound."""
    from tpulab.errors import TpulabError
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.serve import Service, artifacts_loader
    from tpulab.inference.serve_http import run_server

    now, cfg = [0.0], ServeConfig(ready_timeout_s=20)
    release = threading.Event()

    def held():
        release.wait(120)
        raise TpulabError("released")

    loaders = {name: artifacts_loader(_damaged(verified_artifacts, tmp_path, name))
               for name in ("unverified", "tampered", "swapped")}  # fmt: skip
    loaders["held"] = held
    runs = {}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(tmp_path / "corrupt.log", "wb"))
        args = ("--artifacts", str(_damaged(verified_artifacts, tmp_path, "corrupt")))
        t0 = time.monotonic()
        proc = start_server(log, *args, "--ready-timeout", "600", port=free_port())
        stack.callback(reap, proc)
        stack.callback(release.set)
        for name, loader in loaders.items():
            service = Service(loader, cfg, describe=name, clock=lambda: now[0])
            service.start()
            port, ended = free_port(), {}

            def serve(service=service, port=port, ended=ended):
                try:
                    run_server(service, "127.0.0.1", port)
                    ended["error"] = None
                except TpulabError as e:
                    ended["error"] = e

            thread = threading.Thread(target=serve, daemon=True)
            thread.start()
            runs[name] = (service, thread, ended, port)
        for name in ("unverified", "tampered", "swapped"):
            runs[name][1].join(timeout=240)
        rc = proc.wait(timeout=240)
        took = time.monotonic() - t0
        failed = [n for n in runs if n != "held"]
        assert not any(runs[n][1].is_alive() for n in failed)  # ended with the clock at 0
        service, thread, ended, port = runs["held"]
        assert thread.is_alive() and not ended  # still verifying: a wait, not a failure
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503 and "verifying" in ready.json()["status"], ready.text
        now[0] = 20.5  # past the bound: the held server stops on its next tick
        thread.join(timeout=60)
    out = (tmp_path / "corrupt.log").read_text().strip()
    assert rc == ExitCode.FAILED and took < 200, (rc, took, out)  # not the 600 s timeout
    last = out.splitlines()[-1]
    assert last.startswith("error: not ready (artifacts ") and BAD_ARTIFACTS["corrupt"][1] in last
    assert sum(x.startswith("error: ") for x in out.splitlines()) == 1 and "Traceback" not in out
    for name, (_, thread, ended, _) in runs.items():
        err = ended.get("error")
        assert not thread.is_alive() and isinstance(err, TpulabError), (name, err)
        assert err.exit_code == ExitCode.FAILED, (name, err)
        if name == "held":
            assert str(err).startswith("not ready within 20 s: verifying"), err
        else:
            assert str(err).startswith(f"not ready ({name}): "), err
            assert BAD_ARTIFACTS[name][1] in str(err), err


# --- In-process servers (real uvicorn on loopback) with injected loaders and engines --------------


@contextlib.contextmanager
def in_process(service):
    import uvicorn

    from tpulab.inference.serve_http import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _Gated:
    """Delegates to a real engine once ``gate`` is set; counts the generations asked of it."""

    def __init__(self, engine, gate: threading.Event, calls: list):
        self.engine, self.gate, self.calls, self.max_len = engine, gate, calls, engine.max_len

    def batch_for(self, n):
        return self.engine.batch_for(n)

    def width_for(self, n):
        return self.engine.width_for(n)

    def compiled_variants(self):
        return self.engine.compiled_variants()

    def generate(self, *args):
        self.calls.append(time.monotonic())
        assert self.gate.wait(60)
        return self.engine.generate(*args)


@pytest.fixture(scope="module")
def loaded_model(verified_artifacts):
    """One verified, deserialized model for the in-process services below (each wraps its engines
    in its own stand-ins): one load and one compile per policy instead of three."""
    from tpulab.inference.serve import artifacts_loader

    return artifacts_loader(verified_artifacts)()


def test_ready_only_after_verification_and_a_real_inference(loaded_model):
    """/readyz stays 503 (and /livez 200, /v1/generate 503) while the loader has not returned and
    while the engine's first generation is held; it turns 200 only after the first path's
    compile-time generation and the probe through the batcher have run (fp32 x bucket 1, + 1)."""
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.serve import Service

    verified, gate, calls = threading.Event(), threading.Event(), []

    def loader():
        assert verified.wait(60)  # stands in for a slow verification
        m = loaded_model
        gated = {p: _Gated(e, gate, calls) for p, e in m.engines.items()}
        return dataclasses.replace(m, engines=gated)

    service = Service(loader, ServeConfig(max_batch=1))

    def probe(base):
        live = httpx.get(f"{base}/livez", timeout=5).status_code
        ready = httpx.get(f"{base}/readyz", timeout=5)
        gen = httpx.post(f"{base}/v1/generate", json={"prompt": "a", "max_new": 1}, timeout=5)
        return live, ready.status_code, gen.status_code, ready.json()["status"]

    with in_process(service) as base:
        held = [probe(base) for _ in range(5)]
        assert all(p[:3] == (200, 503, 503) and "verifying" in p[3] for p in held), held
        verified.set()
        deadline = time.monotonic() + 60
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = [probe(base) for _ in range(5)]
        assert all(p[:3] == (200, 503, 503) and "compiling" in p[3] for p in held), held
        gate.set()
        deadline = time.monotonic() + 120
        while (r := httpx.get(f"{base}/readyz", timeout=5)).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.02)
        assert len(calls) == 1 + 1, calls  # the first path's compile, then the probe
        assert r.json()["probe"]["tokens"] >= 1


def test_a_probe_that_disagrees_with_the_direct_call_is_not_ready(loaded_model):
    """Negative control of the probe check: an engine that answers the batcher's probe with other
    tokens than the compile-time call leaves the service failed, never ready."""
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.serve import Service

    real = lambda: loaded_model  # noqa: E731

    class Liar(_Gated):
        def generate(self, *args):
            out_bs, n_b = self.engine.generate(*args)
            self.calls.append(1)
            return (out_bs + 1 if len(self.calls) > 1 else out_bs), n_b

    def loader():
        m, calls = real(), []
        return dataclasses.replace(
            m, engines={p: Liar(e, None, calls) for p, e in m.engines.items()}
        )

    service = Service(loader, ServeConfig(max_batch=1))
    service._bring_up()
    assert not service.ready.is_set() and "readiness probe" in service.failure, service.failure


def test_failed_warm_up_is_live_never_ready_and_overdue_on_the_injected_clock(loaded_model):
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.serve import Service

    class Broken:
        max_len = 32

        def batch_for(self, n):
            return n

        def width_for(self, n):
            return 32

        def compiled_variants(self):
            return 0

        def generate(self, *args):
            raise RuntimeError("device lost")

    now = [0.0]
    loader = lambda: dataclasses.replace(loaded_model, engines={"fp32": Broken()})  # noqa: E731
    service = Service(loader, ServeConfig(max_batch=1, ready_timeout_s=30), clock=lambda: now[0])
    service._bring_up()
    assert not service.ready.is_set() and "device lost" in service.failure
    assert service.model is None and not service.overdue()
    now[0] = 30.5
    assert service.overdue() and "device lost" in service.not_ready_reason()


def test_a_request_past_its_deadline_expires_in_the_queue_on_the_injected_clock():
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.generate import Request as GenerationRequest
    from tpulab.inference.serve_batcher import Batcher
    from tpulab.model.sampling import SamplingConfig

    now = [100.0]
    batcher = Batcher(ServeConfig(request_timeout_s=5.0), clock=lambda: now[0])
    batcher.swap(type("M", (), {"max_len": 32})(), {"fp32": [1, 2]})
    req = GenerationRequest.of("a", SamplingConfig(max_new=1), 32)
    late, fresh = batcher.submit(req, "fp32"), None
    now[0] = 105.5  # 5.5 s later: past the first request's deadline
    fresh = batcher.submit(req, "fp32")
    jobs, _, bucket = batcher._take()
    assert [j.future for j in jobs] == [fresh] and bucket == 1
    with pytest.raises(TimeoutError, match="expired in the queue"):
        late.result(timeout=0)


# --- Backpressure with the device work slowed by an injected engine ------------------------------


class _SlowEngine(_Gated):
    """Delegates to a real engine after ``delay`` seconds: stands in for long generations."""

    def __init__(self, engine, delay):
        super().__init__(engine, None, [])
        self.delay = delay

    def generate(self, *args):
        time.sleep(self.delay)
        return self.engine.generate(*args)


@pytest.fixture(scope="module")
def slow_server(verified_artifacts, trained_run):
    from tpulab.inference.config import ServeConfig
    from tpulab.inference.serve import Service, artifacts_loader

    cfg = ServeConfig(
        max_batch=1, batch_window_ms=0, max_queue=3, request_timeout_s=1.0, retry_after_s=2
    )
    service = Service(artifacts_loader(verified_artifacts, trained_run), cfg)  # re-verified
    with in_process(service) as base:
        deadline = time.monotonic() + 180
        while not service.ready.is_set() and time.monotonic() < deadline:
            assert service.failure is None, service.failure
            time.sleep(0.1)
        assert service.ready.is_set(), service.failure
        m = service.model
        service.batcher.swap(
            dataclasses.replace(m, engines={p: _SlowEngine(e, 0.6) for p, e in m.engines.items()}),
            {"fp32": [1]},  # max_batch 1: the one path, compiled at ready
        )
        yield base, service


def test_run_dir_server_says_it_reverified_against_the_checkpoint(slow_server):
    base, _ = slow_server
    v = httpx.get(f"{base}/v1/model", timeout=10).json()["verification"]
    assert v["mode"] == "checkpoint" and v["weights"] == "bitwise equal to the checkpoint"


def test_overflow_503_time_limit_504_and_readyz_stays_responsive(slow_server):
    base, _ = slow_server
    body = {"prompt": "To", "max_new": 4, "temperature": 0.0}

    def call(_):
        r = httpx.post(f"{base}/v1/generate", json=body, timeout=30)
        return r.status_code, r.headers.get("retry-after"), r.json()

    health = []
    probe = httpx.Client(timeout=10)
    assert probe.get(f"{base}/readyz").status_code == 200  # connection open before the storm
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, i) for i in range(8)]
        while not all(f.done() for f in futures):
            t0 = time.perf_counter()
            r = probe.get(f"{base}/readyz")
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
    assert max(dt for _, dt, _ in busy) < 0.5, busy  # the device work (0.6 s/batch) never blocks it
    # After the storm (and the batch whose client gave up, which cannot be interrupted) it serves.
    deadline = time.monotonic() + 10
    while (
        httpx.get(f"{base}/v1/stats", timeout=10).json()["queued"] and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    time.sleep(0.7)
    assert call(0)[0] == 200
