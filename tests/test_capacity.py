"""The capacity model: arithmetic on the committed serve-bench tables, and the 2-replica validation
machinery driven over loopback against stub replicas whose capacity is known by construction
(each serializes 50 ms requests: 20 req/s), with a pair sharing one lock as the negative control.
The real 2-replica measurement is ``benchmarks/capacity_2replica.py`` (results committed)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from tpulab.errors import TpulabError
from tpulab.ops import capacity as cap

TABLE = REPO / "benchmarks/results/serve_bench_demo_window0/serve_bench.json"
SERVICE_S = 0.05


def test_capacity_at_a_p99_target_from_the_committed_table():
    rows = cap.rows_from(json.loads(TABLE.read_text()), "batching")
    assert [r["clients"] for r in rows] == [1, 4, 8, 16]
    best = cap.capacity_at(rows, 50.0)  # p99 13.5, 36.7, 33.1 qualify; 57.3 (16 clients) does not
    assert best["clients"] == 8 and round(best["requests_per_s"], 1) == 296.6
    assert cap.capacity_at(rows, 1000.0)["clients"] == 16
    with pytest.raises(TpulabError, match=r"no measured point meets p99 <= 5 ms \(the best: 13.5"):
        cap.capacity_at(rows, 5.0)
    assert cap.replicas_for(1000, best["requests_per_s"], 0.3) == 5  # 1000 / (296.6 * 0.7) = 4.8
    assert cap.replicas_for(203.07, 290.1, 0.3) == 1 and cap.replicas_for(203.08, 290.1, 0.3) == 2
    with pytest.raises(TpulabError, match="headroom"):
        cap.replicas_for(10, 290.1, 1.0)
    law = cap.littles_law(best)
    assert law["latency"].startswith("p50") and 0 < law["ratio"] < 1.2


def test_capacity_command(tmp_path):
    r = run_cli(
        "capacity", "--table", str(TABLE), "--p99-ms", "50", "--load", "1000", "--headroom", "0.3"
    )
    assert r.returncode == 0, r.stderr
    assert "296.6 req/s at p99 33.1 ms" in r.stdout and "needs 5 replica(s)" in r.stdout
    bad = run_cli("capacity", "--table", str(TABLE), "--p99-ms", "1", "--load", "10")
    assert bad.returncode != 0 and bad.stderr.startswith("error: no measured point")


def test_prediction_is_replicas_times_one_replica_at_its_share_of_the_clients():
    single = [
        {"clients": 1, "requests_per_s": 100.0, "latency_p99_ms": 12.0},
        {"clients": 4, "requests_per_s": 250.0, "latency_p99_ms": 30.0},
    ]
    assert cap.predict(single, 2, 8) == {
        "requests_per_s": 500.0,
        "latency_p99_ms": 30.0,
        "from_clients": 4,
    }
    assert cap.predict(single, 2, 3) is None and cap.predict(single, 2, 4) is None
    # Each replica measured alone: the sum of the two at their share, at the worse p99
    each = [{**single[1], "replica": 0}, {**single[1], "requests_per_s": 200.0, "replica": 1}]
    each[1]["latency_p99_ms"] = 41.0
    assert cap.predict(each, 2, 8) == {
        "requests_per_s": 450.0,
        "latency_p99_ms": 41.0,
        "from_clients": 4,
    }
    assert cap.predict(each[:1], 2, 8) is None  # replica 1 never measured alone: no prediction
    # "A replica" in a capacity table is the slower of them at each client count
    one = {**single[0], "replica": 0}
    assert cap.rows_from({"single": [*each, one]}) == [one, each[1]]


def test_the_median_round_is_a_measured_round_with_every_rounds_rate():
    rounds = [
        {"requests_per_s": 169.0, "latency_p99_ms": 9.0},
        {"requests_per_s": 149.0, "latency_p99_ms": 12.0},
        {"requests_per_s": 160.0, "latency_p99_ms": 10.0},
    ]
    m = cap.median_round(rounds)
    assert m["requests_per_s"] == 160.0 and m["latency_p99_ms"] == 10.0
    assert m["rounds_requests_per_s"] == [169.0, 149.0, 160.0]
    assert cap.median_round(rounds[:2])["requests_per_s"] == 149.0  # the lower of two
    with pytest.raises(TpulabError, match="repeats=0 must be in"):
        cap.CapacityConfig(repeats=0)
    with pytest.raises(TpulabError, match="cores='all' must be 'own' or 'shared'"):
        cap.CapacityConfig(cores="all")


# --- stub replicas: real HTTP servers in their own process --------------------------------------


def _stub_main(ports: list[int], shared: bool) -> None:
    """Serve POST /v1/generate on each port; each request holds its replica's lock for SERVICE_S
    (one lock for all ports when ``shared``: two 'replicas' on one core)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    one = threading.Lock()

    def handler(lock):
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else headers and body wait on a delayed ACK (40 ms)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    time.sleep(SERVICE_S)
                body = b'{"tokens": 32}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        return H

    for port in ports:
        lock = one if shared else threading.Lock()
        srv = ThreadingHTTPServer(("127.0.0.1", port), handler(lock))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("ready", flush=True)
    time.sleep(600)  # the test kills it long before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stubs(n: int, shared: bool):
    ports = [_free_port() for _ in range(n)]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--stub", ",".join(map(str, ports)), str(int(shared))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc, [f"http://127.0.0.1:{p}" for p in ports]


@pytest.fixture
def stub_pair():
    procs = []

    def start(shared):
        proc, bases = _stubs(2, shared)
        procs.append(proc)
        return proc, bases

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def test_validation_holds_for_independent_replicas_and_fails_for_a_shared_core(stub_pair):
    cfg = cap.CapacityConfig(
        clients_per_replica=(1, 4), requests_per_client=6, tolerance=0.2, repeats=2
    )
    _, bases = stub_pair(False)
    good = cap.validate(bases, cfg)
    # each replica alone and the pair, at both client counts, twice: the medians are reported
    assert [(r["replica"], r["clients"]) for r in good["single"]] == [
        (0, 1),
        (1, 1),
        (0, 4),
        (1, 4),
    ]
    assert len(good["rounds"]["single"]) == 8 and len(good["rounds"]["replicated"]) == 4
    assert all(len(r["rounds_requests_per_s"]) == 2 for r in [*good["single"], *good["replicated"]])
    for r in good["single"]:
        assert r["requests_per_s"] <= 1.02 / SERVICE_S, r  # never more than the lock allows
        if r["clients"] > 1:  # saturated (a lone client idles the lock between its requests)
            assert r["requests_per_s"] == pytest.approx(1 / SERVICE_S, rel=0.25), r
    for r in good["replicated"]:
        assert r["per_replica_requests"] == [r["requests"] // 2] * 2  # round robin
        assert r["predicted"]["requests_per_s"] == pytest.approx(2 / SERVICE_S, rel=0.25)
        assert r["within_tolerance"], r
    for r in [*good["single"], *good["replicated"]]:  # closed loop: in flight = clients
        assert r["littles_law"]["latency"] == "mean"
        assert r["littles_law"]["ratio"] == pytest.approx(1.0, abs=0.1), r
    assert good["all_within_tolerance"]
    # Negative control: the same two ports backed by one lock (one core for both) carry one
    # replica's load, and the validation says the prediction failed.
    _, bases = stub_pair(True)
    bad = cap.validate(bases, cfg)
    assert not bad["all_within_tolerance"]
    assert all(r["error"] < -0.3 for r in bad["replicated"]), bad["replicated"]


def test_client_processes_split_the_clients_and_share_one_clock(stub_pair):
    """The measured run's clients: one process per replica, each pinned, starting together; the
    row counts every process's requests over one wall (the earliest start to the latest end)."""
    cfg = cap.CapacityConfig(clients_per_replica=(2,), requests_per_client=6)
    _, bases = stub_pair(False)
    cpus = sorted(os.sched_getaffinity(0))
    for balance in ("connection", "request"):
        cfg = dataclasses.replace(cfg, balance=balance)
        row = cap.round_robin(bases, 4, cfg, [{cpus[0]}, {cpus[-1]}])
        assert row["client_processes"] == 2 and row["requests"] == 24 and row["balance"] == balance
        # round robin across the processes: by request one counter hands out 24 numbers
        assert row["per_replica_requests"] == [12, 12]
        # 24 requests of 50 ms on two independent locks: >= 0.6 s, at most 2 replicas' rate
        assert row["wall_s"] >= 24 * SERVICE_S / 2 * 0.98
        assert row["requests_per_s"] <= 2.05 / SERVICE_S
        assert row["littles_law"]["ratio"] == pytest.approx(1.0, abs=0.15), row
        if balance == "connection":  # 2 clients stay on each replica: never more than its share
            assert row["excess_in_flight"] == 0.0, row
    with pytest.raises(TpulabError, match="5 clients do not split over 2 client processes"):
        cap.round_robin(bases, 5, cfg, [{cpus[0]}, {cpus[-1]}])
    # A client process that fails is one line in the parent, not a hang
    with pytest.raises(TpulabError, match="client process 0: .*ConnectError"):
        cap.round_robin(["http://127.0.0.1:9"], 1, cfg, [{cpus[0]}])


def test_excess_in_flight_sees_two_clients_in_step_on_one_replica():
    """The measure of what the per-process counters did at 3158668: two lone clients meant for
    two replicas, always meeting on one (each holds 2 half the time, 0 the other half)."""
    in_step = [(2 * k, 2 * k + 1, k % 2, 32) for k in range(10)]
    in_step += [(t0, t1, r, n) for t0, t1, r, n in in_step]  # the other client, same requests
    assert cap.excess_in_flight(in_step, 2, 1) == pytest.approx(0.5)
    # control: the same requests spread, one on each replica at every moment
    spread = [(2 * k, 2 * k + 1, (k + j) % 2, 32) for k in range(10) for j in (0, 1)]
    assert cap.excess_in_flight(spread, 2, 1) == 0.0
    assert cap.excess_in_flight(in_step, 2, 2) == 0.0  # 2 each is the share at 2 per replica
    with pytest.raises(TpulabError, match="balance='rr' must be 'connection' or 'request'"):
        cap.CapacityConfig(balance="rr")


def test_pin_moves_every_thread_of_a_process(stub_pair):
    cpus = sorted(os.sched_getaffinity(0))
    proc, _ = stub_pair(False)
    tasks = Path(f"/proc/{proc.pid}/task")

    def allowed():
        return {
            (t / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
            for t in tasks.iterdir()
        }

    before = allowed()
    n = cap.pin(proc.pid, {cpus[-1]})
    assert n == len(list(tasks.iterdir())) >= 3  # main + one server thread per port
    assert allowed() == {str(cpus[-1])}
    if len(cpus) > 1:  # negative control: before pinning the threads could run anywhere
        assert before != {str(cpus[-1])}


if __name__ == "__main__" and sys.argv[1:2] == ["--stub"]:
    _stub_main([int(p) for p in sys.argv[2].split(",")], sys.argv[3] == "1")
