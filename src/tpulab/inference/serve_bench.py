"""Capacity table: the real service (its own process) driven over loopback by 1, 4, 16 clients.

Two servers on the same artifacts, one after the other: the serial baseline (``max_batch`` 1: one
request per device dispatch, what a one-at-a-time service does) and the batching service. Each
client sends ``requests_per_client`` greedy requests back to back (same prompt, ``max_new`` tokens,
no stop token, so every request generates exactly ``max_new`` tokens). Reported per row:
requests/s and generated tokens/s over the wall time of the round, p50/p99 latency, and time to
first byte of the response (TTFT; responses are not streamed, so it is the latency minus the
transfer), plus the batch sizes the server formed (from /v1/stats). A benchmark, run by hand.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, check_out
from tpulab.config import check, field
from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import table


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """The requests a serving measurement sends and the batching of the servers it starts: one
    shape for the serve-bench tables and the capacity run (``tpulab.ops.capacity``)."""

    max_new: int = field(32, "tokens per request (greedy, no stop token: always max_new)")
    prompt: str = field("ROMEO:", "the prompt of every request")
    cache: str = field("fp32", "cache policy")
    max_batch: int = field(16, "each server's max batch")
    batch_window_ms: float = field(0.0, "each server's batch window")

    def body(self) -> dict:
        """The JSON body of every request: greedy, ``max_new`` tokens of ``prompt``."""
        return {
            "prompt": self.prompt,
            "max_new": self.max_new,
            "temperature": 0.0,
            "cache": self.cache,
        }


@dataclasses.dataclass(frozen=True)
class BenchConfig(RequestShape):
    clients: tuple[int, ...] = field((1, 4, 16), "concurrent clients per round")
    requests_per_client: int = field(8, "requests each client sends, back to back")
    startup_timeout_s: float = field(600.0, "how long a server may take to become ready")

    def __post_init__(self):
        check(
            all(0 < c <= 256 for c in self.clients), f"clients={self.clients} must be in [1, 256]"
        )
        check(0 < self.requests_per_client <= 10_000, "requests must be in [1, 10000]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``tpulab serve`` in its own process group, always reaped."""

    def __init__(
        self, artifacts: Path, max_batch: int, window_ms: float, log: Path, timeout: float
    ):
        import httpx

        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tpulab.cli",
                "serve",
                "--artifacts",
                str(artifacts),
                "--port",
                str(self.port),
                "--max-batch",
                str(max_batch),
                "--batch-window-ms",
                str(window_ms),
                "--max-queue",
                "1024",
                "--request-timeout",
                "600",
                "--trace-log",
                str(log.with_suffix(".traces.jsonl")),  # beside its log, not in the cwd
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ.copy(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise TpulabError(
                    f"server exited with {self.proc.returncode}: "
                    f"{log.read_text().strip().splitlines()[-1:]}"
                )
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise TpulabError(f"server not ready within {timeout:g} s (log: {log})")

    def close(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)
        self.log.close()


def _round(base: str, clients: int, cfg: BenchConfig) -> dict:
    import httpx

    body = cfg.body()

    def client(_):
        out = []
        with httpx.Client(timeout=600) as c:
            for _ in range(cfg.requests_per_client):
                t0 = time.perf_counter()
                with c.stream("POST", f"{base}/v1/generate", json=body) as r:
                    chunks = r.iter_raw()
                    first = next(chunks, b"")
                    t_first = time.perf_counter()
                    data = first + b"".join(chunks)
                t1 = time.perf_counter()
                if r.status_code != 200:
                    raise TpulabError(f"server answered {r.status_code}: {data[:200]!r}")
                import json

                out.append((t1 - t0, t_first - t0, json.loads(data)["tokens"]))
        return out

    before = httpx.get(f"{base}/v1/stats", timeout=10).json()["batches"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(client, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    after = httpx.get(f"{base}/v1/stats", timeout=10).json()["batches"]
    lat = np.array([r[0] for r in results]) * 1e3
    ttft = np.array([r[1] for r in results]) * 1e3
    tokens = sum(r[2] for r in results)
    formed = {
        k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)
    }
    return {
        "clients": clients,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_ms": float(np.percentile(lat, 50)),
        "latency_p99_ms": float(np.percentile(lat, 99)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "batches_formed": formed,
    }


def serve_bench(artifacts: str | Path, cfg: BenchConfig, out_dir: str | Path) -> dict:
    """Run both servers through every client count; write ``serve_bench.{json,md}``."""
    from tpulab.evidence.provenance import describe_hardware, environment
    from tpulab.inference.trust import load_verified

    out = check_out(out_dir)  # a non-empty one is refused before anything starts
    art = load_verified(artifacts)  # refuse unverified artifacts here, before starting servers
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for name, max_batch in (
            ("serial (max_batch 1)", 1),
            (f"batching (max_batch {cfg.max_batch})", cfg.max_batch),
        ):
            server = _Server(
                Path(artifacts),
                max_batch,
                cfg.batch_window_ms,
                Path(tmp) / f"{max_batch}.log",
                cfg.startup_timeout_s,
            )
            try:
                _round(
                    server.base, 1, dataclasses.replace(cfg, requests_per_client=2)
                )  # warm the connection path
                for clients in cfg.clients:
                    row = {"server": name, **_round(server.base, clients, cfg)}
                    rows.append(row)
                    print(
                        f"{name:>24} clients={clients:<3} {row['requests_per_s']:8.1f} req/s "
                        f"{row['tokens_per_s']:9.1f} tok/s p50 {row['latency_p50_ms']:7.1f} ms "
                        f"p99 {row['latency_p99_ms']:7.1f} ms",
                        flush=True,
                    )
            finally:
                server.close()
    env = environment()
    serial = {r["clients"]: r for r in rows if r["server"].startswith("serial")}
    for r in rows:
        base = serial.get(r["clients"])
        r["throughput_vs_serial"] = r["requests_per_s"] / base["requests_per_s"] if base else None
    result = {
        "rows": rows,
        "config": dataclasses.asdict(cfg),
        "environment": env,
        "hardware": describe_hardware(env),
        "artifacts": str(Path(artifacts).resolve()),
        "manifest_sha256": art.manifest_sha256,
        "model": art.manifest["model"],
        "max_len": art.max_len,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    atomic_write_json(out / "serve_bench.json", result)
    atomic_write_bytes(out / "serve_bench.md", (capacity_table(result) + "\n").encode())
    print(capacity_table(result))
    return result


def capacity_table(result: dict) -> str:
    c, m = result["config"], result["model"]
    lines = [
        f"{result['hardware']}; jax {result['environment']['packages']['jax']}; "
        f"model d_model {m['d_model']}, {m['n_layers']} layers, max_seq_len {m['max_seq_len']}; "
        f"cache {c['cache']}; prompt {c['prompt']!r}, {c['max_new']} new tokens, greedy; "
        f"{c['requests_per_client']} requests per client; window {c['batch_window_ms']} ms; "
        f"load average before {result['loadavg_before'][0]:.1f}, after "
        f"{result['loadavg_after'][0]:.1f} (shared machine).",
        "",
    ]
    rows = []
    for r in result["rows"]:
        vs = f"{r['throughput_vs_serial']:.2f}x" if r["throughput_vs_serial"] else "-"
        formed = ", ".join(
            f"{k}:{v}" for k, v in sorted(r["batches_formed"].items(), key=lambda kv: int(kv[0]))
        )
        rows.append(
            (
                r["server"],
                r["clients"],
                f"{r['requests_per_s']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                f"{r['ttft_p50_ms']:.1f}",
                vs,
                formed,
            )
        )
    headers = ["server", "clients", "req/s", "tok/s", "p50 ms", "p99 ms", "TTFT p50 ms"]
    lines.append(table([*headers, "vs serial", "batch size:count"], rows))
    return "\n".join(lines)
