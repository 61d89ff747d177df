"""Capacity model check: 2 pinned replicas behind a round-robin client against 2 x one replica.

    python benchmarks/capacity_2replica.py --artifacts ART [--out OUT]
        [--clients 1 2 4 8] [--requests 30] [--repeats 3] [--p99-ms 50]
        [--balance connection|request] [--cores own|shared]

ART: verified export artifacts (tpulab export + verify-export) of the model to size, e.g. the
default config's (the serve-bench tables' model). Starts 2 real services (tpulab serve), each
process pinned to its own core, measures each alone at c clients and both behind the round-robin
client at 2c, ``--repeats`` rounds of each interleaved (the medians compared), and writes
OUT/capacity.json (raw rows of every round, provenance, load average) and OUT/capacity.md
(default OUT: benchmarks/results/capacity_2replica). A benchmark, not a test: numbers depend on
the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/capacity_2replica"))
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="per replica")
    parser.add_argument("--requests", type=int, default=None, help="requests per client")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds of each")
    parser.add_argument("--p99-ms", type=float, default=None)
    parser.add_argument("--balance", choices=("connection", "request"), default=None)
    parser.add_argument(
        "--cores", choices=("own", "shared"), default=None, help="shared: the negative control"
    )
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()  # as the CLI does, before JAX starts its threads or a backend
    from tpulab.ops.capacity import CapacityConfig, capacity_table, measure

    cfg = CapacityConfig()
    changes = {
        "clients_per_replica": tuple(args.clients) if args.clients else None,
        "requests_per_client": args.requests,
        "repeats": args.repeats,
        "p99_ms": args.p99_ms,
        "balance": args.balance,
        "cores": args.cores,
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
    result = measure(args.artifacts, cfg, args.out)
    print(capacity_table(result))


if __name__ == "__main__":
    main()
