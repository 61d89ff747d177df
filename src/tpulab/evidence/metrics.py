"""Append-only per-step metrics (metrics.jsonl), shared by every trainer in tpulab.

Each process that writes to a run dir first appends a ``{"event": "start", "segment": n, ...}``
record; its step records carry the same ``segment``. A killed-then-resumed run therefore keeps
both curves, the killed one (segment 0) and the resumed one (segment 1), in one file, and the
proof reads them apart. Every line is flushed as it is written: a SIGKILL loses at most the line
being written, never an earlier one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpulab.checkpoint.rundir import METRICS

__all__ = ["METRICS", "MetricsLog", "curve", "read_records", "starts"]


class MetricsLog:
    def __init__(self, run_dir: str | Path, **start_info):
        self.path = Path(run_dir) / METRICS
        self.segment = sum(1 for r in read_records(self.path) if r.get("event") == "start")
        self._f = open(self.path, "a", buffering=1)
        self._write({"event": "start", "segment": self.segment, "pid": os.getpid(), **start_info})

    def _write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def log(self, step: int, **values) -> None:
        self._write({"step": int(step), "segment": self.segment, **values})

    def event(self, event: str, **values) -> None:
        self._write({"event": event, "segment": self.segment, **values})

    def close(self) -> None:
        self._f.close()


def read_records(path: str | Path) -> list[dict]:
    """All complete records; a torn last line (a kill mid-write) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def curve(records: list[dict], key: str = "loss", segment: int | None = None) -> dict[int, float]:
    """step -> value for step records (optionally of one segment); a later record of a step wins."""
    return {
        r["step"]: r[key]
        for r in records
        if "step" in r and key in r and (segment is None or r.get("segment") == segment)
    }


def starts(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "start"]
