"""Capacity: what one replica sustains at a p99 target, how many a load needs, and a measured check.

The model (docs/operations.md, "Capacity"), from closed-loop tables (``serve-bench``, or the
single-replica rows of ``measure``):

- a replica's capacity at a p99 target T is the highest throughput among its measured rows whose
  p99 latency is at most T: measured points only, never extrapolated;
- replicas for a load of L requests/s with headroom h: ``ceil(L / (capacity * (1 - h)))``;
- Little's law on every row: requests in flight = throughput x mean latency must equal the number
  of clients of a closed loop (each always has one request out); the ratio is reported, and a row
  far from 1 was not a steady state (or lost time outside the requests);
- R replicas behind a round-robin client driven by R x c clients: each replica sees c of them, so
  the pair sustains the sum of each replica's ``X_i(c)`` alone (``R * X1(c)`` for like replicas)
  at the worst of their p99s, provided each replica has its own core.

``measure`` checks the last point: it starts R real services (``tpulab serve``, each process
pinned to its own core), measures each replica alone at c clients (the clients in one process
pinned to that replica's core), then all R behind the round-robin client at R x c clients (one
client process per replica, on its core, so each core carries one replica and one client process
in both runs), ``repeats`` times interleaved, and compares the median rounds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tpulab.config import check, field
from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import table
from tpulab.inference.serve_bench import RequestShape


def rows_from(table: dict, server: str = "batching") -> list[dict]:
    """The closed-loop rows of one server (``serve_bench.json``) or the single-replica rows of a
    capacity measurement (``capacity.json``: at each client count the slower replica's)."""
    if "single" in table:
        return slower_replica(table["single"])
    rows = [r for r in table.get("rows", []) if str(r.get("server", "")).startswith(server)]
    if not rows:
        raise TpulabError(f"the table has no rows of a {server!r} server")
    return rows


def slower_replica(rows: list[dict]) -> list[dict]:
    """At each client count the row of the slowest replica measured alone: what "a replica"
    carries, for replicas that need not be alike (two cores of one host differed by up to 5%)."""
    by: dict[int, dict] = {}
    for r in rows:
        c = r["clients"]
        if c not in by or r["requests_per_s"] < by[c]["requests_per_s"]:
            by[c] = r
    return [by[c] for c in sorted(by)]


def load_table(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise TpulabError(f"capacity table {path}: {e.strerror or e}") from None
    except ValueError:
        raise TpulabError(f"capacity table {path} is not JSON") from None


def capacity_at(rows: list[dict], p99_ms: float) -> dict:
    """The measured row with the highest throughput whose p99 meets the target."""
    ok = [r for r in rows if r["latency_p99_ms"] <= p99_ms]
    if not ok:
        best = min(rows, key=lambda r: r["latency_p99_ms"])
        raise TpulabError(
            f"no measured point meets p99 <= {p99_ms:g} ms (the best: {best['latency_p99_ms']:.1f}"
            f" ms at {best['clients']} clients)"
        )
    return max(ok, key=lambda r: r["requests_per_s"])


def replicas_for(load_rps: float, capacity_rps: float, headroom: float) -> int:
    """Replicas that carry ``load_rps`` with each run at ``1 - headroom`` of its capacity."""
    if not (0 <= headroom < 1):
        raise TpulabError(f"headroom {headroom} must be in [0, 1)")
    if not (load_rps > 0 and math.isfinite(load_rps)):
        raise TpulabError(f"load {load_rps} must be a positive number of requests/s")
    return max(1, math.ceil(load_rps / (capacity_rps * (1 - headroom)) - 1e-9))


def littles_law(row: dict) -> dict:
    """In flight = throughput x mean latency, against the clients of the closed loop. Tables
    without a mean latency (serve-bench's) use the p50, which undercounts a skewed tail."""
    mean = row.get("latency_mean_ms")
    w = mean if mean is not None else row["latency_p50_ms"]
    in_flight = row["requests_per_s"] * w / 1e3
    return {
        "in_flight": in_flight,
        "clients": row["clients"],
        "ratio": in_flight / row["clients"],
        "latency": "mean" if mean is not None else "p50 (no mean in the table)",
    }


def plan(
    table: str | Path, p99_ms: float, load_rps: float, headroom: float, server: str = "batching"
) -> dict:
    rows = rows_from(load_table(table), server)
    best = capacity_at(rows, p99_ms)
    n = replicas_for(load_rps, best["requests_per_s"], headroom)
    return {
        "table": str(table),
        "p99_target_ms": p99_ms,
        "load_rps": load_rps,
        "headroom": headroom,
        "per_replica": best,
        "replicas": n,
        "utilization": load_rps / (n * best["requests_per_s"]),
        "littles_law": [littles_law(r) for r in rows],
    }


def plan_text(p: dict) -> str:
    b = p["per_replica"]
    law = ", ".join(f"{x['clients']}:{x['ratio']:.2f}" for x in p["littles_law"])
    return (
        f"one replica: {b['requests_per_s']:.1f} req/s at p99 {b['latency_p99_ms']:.1f} ms "
        f"<= {p['p99_target_ms']:g} ms ({b['clients']} clients); {p['load_rps']:g} req/s with "
        f"{p['headroom']:.0%} headroom needs {p['replicas']} replica(s) (each at "
        f"{p['utilization']:.0%}); Little's law in-flight/clients by clients: {law}"
    )


# --- the measured check -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CapacityConfig(RequestShape):
    """The 2-replica validation run (the serve-bench tables' request shape)."""

    replicas: int = field(2, "replicas behind the round-robin client, each pinned to a core")
    clients_per_replica: tuple[int, ...] = field((1, 2, 4, 8), "closed-loop clients per replica")
    requests_per_client: int = field(30, "requests each client sends, back to back")
    p99_ms: float = field(50.0, "p99 target of the capacity model in the report")
    tolerance: float = field(0.2, "allowed |measured - predicted| / predicted")
    repeats: int = field(
        3,
        "rounds of each kind per client count, interleaved (each replica alone, then all); the "
        "median round of each is compared: one replica at 1 client did 149 and 169 req/s in two "
        "runs at 79f3245, a spread near the tolerance",
    )
    balance: str = field(
        "connection",
        "connection: each client's keep-alive connection stays on replica (client mod R), as an L4"
        " balancer spreads connections; request: each request to the next replica, one counter",
    )
    cores: str = field(
        "own",
        "own: replica i and its client process on core i (the model's premise); shared: every "
        "replica and client process on the first core, the negative control that must fail",
    )
    startup_timeout_s: float = field(900.0, "how long a server may take to become ready")

    def __post_init__(self):
        check(1 <= self.replicas <= 64, f"replicas={self.replicas} must be in [1, 64]")
        check(
            all(0 < c <= 64 for c in self.clients_per_replica),
            f"clients_per_replica={self.clients_per_replica} must be in [1, 64]",
        )
        check(0 < self.requests_per_client <= 10_000, "requests_per_client must be in [1, 10000]")
        check(0 < self.tolerance < 1, f"tolerance={self.tolerance} must be in (0, 1)")
        check(1 <= self.repeats <= 15, f"repeats={self.repeats} must be in [1, 15]")
        check(self.cores in ("own", "shared"), f"cores={self.cores!r} must be 'own' or 'shared'")
        check(
            self.balance in ("connection", "request"),
            f"balance={self.balance!r} must be 'connection' or 'request'",
        )


def pin(pid: int, cpus: set[int]) -> int:
    """Pin every thread of ``pid`` to ``cpus`` (threads it starts later inherit it); returns the
    number of threads pinned."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            n += 1
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return n


def _closed_loop(
    bases: list[str], clients: int, cfg: CapacityConfig, route, start
) -> tuple[list, float, float]:
    """``clients`` closed-loop client threads of this process; client i sends each request to
    ``bases[route(i)]``. (results, start, end) on the monotonic clock, which all processes of this
    host share."""
    import httpx

    body = cfg.body()
    # Clients (an httpx.Client builds an SSL context: tens of ms) and threads exist before the
    # clock starts; all start together at the barrier (``start``: this process's threads, then
    # every client process's).
    sessions = [httpx.Client(timeout=600) for _ in range(clients)]
    ready = threading.Barrier(clients + 1)

    def client(i):
        out, c = [], sessions[i]
        ready.wait()
        for _ in range(cfg.requests_per_client):
            target = route(i)
            t0 = time.monotonic()
            r = c.post(f"{bases[target]}/v1/generate", json=body)
            t1 = time.monotonic()
            if r.status_code != 200:
                raise TpulabError(f"replica {target} answered {r.status_code}: {r.text[:200]}")
            out.append((t0, t1, target, r.json()["tokens"]))
        return out

    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(client, i) for i in range(clients)]
            start()
            ready.wait()
            t0 = time.monotonic()
            results = [x for f in futures for x in f.result()]
            t1 = time.monotonic()
    finally:
        for c in sessions:
            c.close()
    return results, t0, t1


def _router(cfg: CapacityConfig, replicas: int, j: int, n: int, counter):
    """Client i of process j (of n): by connection, replica (j + i n) mod R, so with one process
    per replica process j drives replica j alone; by request, the next value of one counter."""
    if cfg.balance == "connection":
        return lambda i: (j + i * n) % replicas

    def route(i):
        with counter.get_lock():  # one counter for all processes: ~2 us a request
            k = counter.value
            counter.value = k + 1
        return k % replicas

    return route


def _client_process(bases, clients, cfg, j, n, cpus, barrier, queue, counter) -> None:
    os.sched_setaffinity(0, cpus)
    try:
        route = _router(cfg, len(bases), j, n, counter)
        # A process that never reaches the barrier (it failed first) breaks it for the others.
        queue.put(_closed_loop(bases, clients, cfg, route, lambda: barrier.wait(120)))
    except BaseException as e:  # the parent raises it in one line
        queue.put(f"client process {j}: {type(e).__name__}: {e}")


class _Counter:
    """multiprocessing.Value's interface for the clients of one process."""

    def __init__(self):
        self.value, self._lock = 0, threading.Lock()

    def get_lock(self):
        return self._lock


def excess_in_flight(results: list, replicas: int, per_replica: float) -> float:
    """The share of request-time spent beyond ``per_replica`` requests in flight on one replica:
    0 when every replica always holds its share, 0.5 when two clients meant for two replicas
    always meet on one (each replica then holds 2 half the time and 0 the other half)."""
    over = total = 0.0
    for i in range(replicas):
        events = sorted(
            [(r[0], 1) for r in results if r[2] == i] + [(r[1], -1) for r in results if r[2] == i]
        )
        n, last = 0, None
        for t, d in events:
            if last is not None:
                over += max(0.0, n - per_replica) * (t - last)
                total += n * (t - last)
            n, last = n + d, t
    return over / total if total else 0.0


def round_robin(
    bases: list[str], clients: int, cfg: CapacityConfig, client_cpus: list[set[int]] | None = None
) -> dict:
    """``clients`` closed-loop clients spread round robin over ``bases`` (``cfg.balance``).

    ``client_cpus``: run the clients in ``len(client_cpus)`` processes, process j pinned to
    ``client_cpus[j]`` with its share of the clients, all starting together (by request, all
    drawing from one shared counter). Without it the clients are threads of this process: one
    interpreter lock for all of them, which the replicated rounds must not share (``validate``).

    Measured on this 2-core host (benchmarks/results/capacity_2replica_*): at 3158668 each
    process kept a request counter of its own, starting at replica j. Two lone clients then fell
    into step on one replica (a batch of both, answered together, so both next went to the other)
    and stayed there: 99% of their requests overlapped, -52% against twice one replica. One
    shared counter undoes such a meeting at the next request, but still leaves 18-22% of the
    request-time beyond a replica's share of the clients from 2 clients per replica on (-28% at
    2). Spread by connection, every replica holds exactly its share, which is what the capacity
    model assumes.
    """
    if not client_cpus:
        route = _router(cfg, len(bases), 0, 1, _Counter())
        results, t0, t1 = _closed_loop(bases, clients, cfg, route, lambda: None)
    else:
        import multiprocessing

        n = len(client_cpus)
        if clients % n:
            raise TpulabError(f"{clients} clients do not split over {n} client processes")
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        barrier, queue, counter = ctx.Barrier(n), ctx.Queue(), ctx.Value("q", 0)
        procs = [
            ctx.Process(
                target=_client_process,
                args=(bases, clients // n, cfg, j, n, client_cpus[j], barrier, queue, counter),
                daemon=True,
            )
            for j in range(n)
        ]
        for p in procs:
            p.start()
        try:
            parts = [queue.get(timeout=cfg.startup_timeout_s) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        failed = [x for x in parts if isinstance(x, str)]
        if failed:
            raise TpulabError(failed[0])
        results = [x for part in parts for x in part[0]]
        t0, t1 = min(p[1] for p in parts), max(p[2] for p in parts)
    wall = t1 - t0
    lat = np.array([r[1] - r[0] for r in results]) * 1e3
    row = {
        "replicas": len(bases),
        "clients": clients,
        "client_processes": len(client_cpus or [None]),
        "balance": cfg.balance,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r[3] for r in results) / wall,
        "latency_mean_ms": float(lat.mean()),
        "latency_p50_ms": float(np.percentile(lat, 50)),
        "latency_p99_ms": float(np.percentile(lat, 99)),
        "per_replica_requests": [sum(1 for r in results if r[2] == i) for i in range(len(bases))],
        "excess_in_flight": excess_in_flight(results, len(bases), clients / len(bases)),
    }
    row["littles_law"] = littles_law(row)
    return row


def predict(single: list[dict], replicas: int, clients: int) -> dict | None:
    """R replicas at R x c clients: the sum of each replica's throughput alone at c, at the worst
    of their p99s. Rows without a ``replica`` (a serve-bench table: one replica measured) stand
    for every replica: R times one replica's throughput."""
    if clients % replicas:
        return None
    c = clients // replicas
    at = [r for r in single if r["clients"] == c]
    if not at:
        return None
    if all("replica" in r for r in at):
        by = {r["replica"]: r for r in at}
        if sorted(by) != list(range(replicas)):
            return None
        rows = [by[i] for i in range(replicas)]
    else:
        rows = [at[0]] * replicas
    return {
        "requests_per_s": sum(r["requests_per_s"] for r in rows),
        "latency_p99_ms": max(r["latency_p99_ms"] for r in rows),
        "from_clients": c,
    }


def median_round(rounds: list[dict]) -> dict:
    """The round of median throughput (the lower median of an even count), with every round's
    req/s attached: a measured row, so its latencies and counts belong together."""
    ranked = sorted(rounds, key=lambda r: r["requests_per_s"])
    return {
        **ranked[(len(ranked) - 1) // 2],
        "rounds_requests_per_s": [r["requests_per_s"] for r in rounds],
    }


def validate(
    bases: list[str], cfg: CapacityConfig, client_cpus: list[set[int]] | None = None
) -> dict:
    """For every c, ``cfg.repeats`` interleaved rounds of each replica alone at c clients and of
    all ``bases`` behind the round-robin client at len(bases) x c; the median replicated round
    compared with the prediction from each replica's median round alone.

    ``client_cpus``: one set per replica, the core of that replica. A replica's round alone then
    runs its clients in one process on its core, the replicated rounds in one process per replica
    on its core, so in both a core carries one replica and one client process with c clients. At
    bb1acf2 one client process (one interpreter lock) drove both replicas, and the pair levelled
    off at ~200 req/s from 2 clients per replica on, -26% at 8.
    """
    n = len(bases)
    round_robin(bases, n, dataclasses.replace(cfg, requests_per_client=2))  # untimed
    rounds: dict[str, list[dict]] = {"single": [], "replicated": []}
    single, multi = [], []
    for c in cfg.clients_per_replica:
        alone: list[list[dict]] = [[] for _ in bases]
        together = []
        for _ in range(cfg.repeats):
            for i in range(n):
                row = round_robin([bases[i]], c, cfg, client_cpus and [client_cpus[i]])
                alone[i].append({**row, "replica": i})
                print(_row_line(alone[i][-1]), flush=True)
            together.append(round_robin(bases, c * n, cfg, client_cpus))
            print(_row_line(together[-1]), flush=True)
        single += [median_round(a) for a in alone]
        multi.append(median_round(together))
        rounds["single"] += [r for a in alone for r in a]
        rounds["replicated"] += together
    for r in multi:
        r["predicted"] = predict(single, r["replicas"], r["clients"])
        p = r["predicted"]["requests_per_s"]
        r["error"] = (r["requests_per_s"] - p) / p
        r["within_tolerance"] = abs(r["error"]) <= cfg.tolerance
    return {
        "single": single,
        "replicated": multi,
        "rounds": rounds,
        "all_within_tolerance": all(r["within_tolerance"] for r in multi),
        "capacity_at_p99": _safe_capacity(slower_replica(single), cfg.p99_ms),
    }


def measure(artifacts: str | Path, cfg: CapacityConfig, out_dir: str | Path) -> dict:
    """Start ``cfg.replicas`` services (``tpulab serve``), each pinned to its own core, run
    ``validate``; write ``capacity.json`` (raw rows, provenance) and ``capacity.md``."""
    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.evidence.provenance import describe_hardware, environment, git_commit
    from tpulab.inference.serve_bench import _Server
    from tpulab.inference.trust import load_verified

    art = load_verified(artifacts)  # refuse unverified artifacts before starting anything
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < cfg.replicas:
        raise TpulabError(
            f"{cfg.replicas} replicas need {cfg.replicas} cores; this has {len(cpus)}"
        )
    core = cpus[: cfg.replicas] if cfg.cores == "own" else [cpus[0]] * cfg.replicas
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_before, t_start = os.getloadavg(), time.time()
    servers = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(cfg.replicas):
                log = Path(tmp) / f"replica{i}.log"
                s = _Server(
                    Path(artifacts), cfg.max_batch, cfg.batch_window_ms, log, cfg.startup_timeout_s
                )
                servers.append(s)
                pin(s.proc.pid, {core[i]})
            client_cpus = [{core[i]} for i in range(cfg.replicas)]
            result = validate([s.base for s in servers], cfg, client_cpus=client_cpus)
        finally:
            for s in servers:
                s.close()
    env = environment()
    result.update(
        {
            "config": dataclasses.asdict(cfg),
            "artifacts": str(Path(artifacts).resolve()),
            "manifest_sha256": art.manifest_sha256,
            "model": art.manifest["model"],
            "environment": env,
            "hardware": describe_hardware(env),
            "commit": git_commit(),
            "cpus": core,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "started_unix": t_start,
            "seconds": time.time() - t_start,
        }
    )
    atomic_write_json(out / "capacity.json", result)
    atomic_write_bytes(out / "capacity.md", (capacity_table(result) + "\n").encode())
    return result


def _safe_capacity(rows: list[dict], p99_ms: float) -> dict | None:
    try:
        return capacity_at(rows, p99_ms)
    except TpulabError:
        return None


def _row_line(r: dict) -> str:
    who = f"replica {r['replica']}" if "replica" in r else f"{r['replicas']} replicas"
    return (
        f"{who:<10} clients={r['clients']:<3} {r['requests_per_s']:8.1f} req/s "
        f"mean {r['latency_mean_ms']:7.1f} ms p99 {r['latency_p99_ms']:7.1f} ms Little "
        f"{r['littles_law']['ratio']:.2f} beyond share {r['excess_in_flight']:.0%}"
    )


def capacity_table(result: dict) -> str:
    c, m = result["config"], result["model"]
    lines = [
        f"{result['hardware']}; jax {result['environment']['packages']['jax']}; commit "
        f"{result['commit']}; model d_model {m['d_model']}, {m['n_layers']} layers, max_seq_len "
        f"{m['max_seq_len']}; cache {c['cache']}; prompt {c['prompt']!r}, {c['max_new']} new "
        f"tokens, greedy; {c['requests_per_client']} requests per client, median of "
        f"{c.get('repeats', 1)} interleaved round(s), spread by "
        f"{c.get('balance', 'request (one counter per client process)')}; max_batch "
        f"{c['max_batch']}, window {c['batch_window_ms']} ms; replica i pinned to core i of "
        f"{result['cpus']}; load average before {result['loadavg_before'][0]:.1f}, after "
        f"{result['loadavg_after'][0]:.1f} (shared machine).",
        "",
    ]
    rows = []
    for r in [*result["single"], *result["replicated"]]:
        p = r.get("predicted")
        pred = (
            (f"{p['requests_per_s']:.1f}", f"{r['error']:+.1%}", f"{p['latency_p99_ms']:.1f}")
            if p
            else ("-", "-", "-")
        )
        spread = r.get("rounds_requests_per_s", [r["requests_per_s"]])
        rows.append(
            (
                r.get("replica", "all" if r["replicas"] > 1 else 0),
                r["clients"],
                f"{r['requests_per_s']:.1f}",
                f"{min(spread):.0f}-{max(spread):.0f}",
                pred[0],
                pred[1],
                f"{r['latency_mean_ms']:.1f}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                pred[2],
                f"{r['littles_law']['ratio']:.2f}",
                f"{r['excess_in_flight']:.0%}" if "excess_in_flight" in r else "-",
                r["per_replica_requests"],
            )
        )
    headers = ["replica", "clients", "req/s", "rounds req/s", "predicted req/s", "error"]
    headers += ["mean ms", "p50 ms"]
    headers += ["p99 ms", "predicted p99 ms", "Little L/N", "beyond share", "requests per replica"]
    lines.append(table(headers, rows))
    cap = result["capacity_at_p99"]
    verdict = "within" if result["all_within_tolerance"] else "NOT within"
    lines += [
        "",
        f"Capacity of one replica (the slower at each client count) at p99 <= "
        f"{c['p99_ms']:g} ms: "
        + (
            f"{cap['requests_per_s']:.1f} req/s ({cap['clients']} clients, p99 "
            f"{cap['latency_p99_ms']:.1f} ms)."
            if cap
            else "no measured point meets it."
        ),
        f"The {c['replicas']}-replica run is {verdict} {c['tolerance']:.0%} of the prediction "
        f"at every point (worst error "
        f"{max((r['error'] for r in result['replicated']), key=abs):+.1%}).",
    ]
    return "\n".join(lines)
