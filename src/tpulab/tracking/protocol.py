"""The messages between the trainer's tracker and its MLflow helper process, written once.

The trainer writes one JSON line per message on the helper's stdin: first ``Settings``, then any of
``OpenRun``, ``Send``, ``Finish``, ``Terminate``. At end of input the helper prints one ``Outcome``
line on its stdout. Both sides use ``encode``/``decode`` and nothing else, so a field added here
reaches both.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import NamedTuple


class Point(NamedTuple):
    """One metric value: MLflow's (key, value, step, timestamp in ms)."""

    key: str
    value: float
    step: int
    ts_ms: int


@dataclasses.dataclass(frozen=True)
class Settings:
    """First line: which run dir logs to which store, as what kind of run."""

    run_dir: str
    uri: str
    kind: str
    extra_tags: dict


@dataclasses.dataclass(frozen=True)
class OpenRun:
    """Find or create the run dir's MLflow run; log params, lineage tags and the resume record."""

    params: dict
    env: dict | None
    resumed_from: int | None
    digest: str | None


@dataclasses.dataclass(frozen=True)
class Send:
    """Metric points whose steps are covered by a committed checkpoint (or the run ended)."""

    points: list[Point]


@dataclasses.dataclass(frozen=True)
class Finish:
    """The loop ended normally: final metrics, artifacts, FINISHED (or KILLED when preempted)."""

    summary: dict


@dataclasses.dataclass(frozen=True)
class Terminate:
    """The run ended by an error: mark it ``status`` (FAILED)."""

    status: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The helper's last line: the run it logged to and the first failure, if any."""

    run_id: str | None
    failed: str | None


Message = Settings | OpenRun | Send | Finish | Terminate | Outcome
_TYPES = {c.__name__: c for c in (Settings, OpenRun, Send, Finish, Terminate, Outcome)}


def encode(message: Message) -> str:
    """One JSON line. Values JSON cannot hold (a Path in env, a date) are sent as their str()."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    return json.dumps({"type": type(message).__name__, **fields}, default=str) + "\n"


def decode(line: str) -> Message:
    data = json.loads(line)
    cls = _TYPES.get(data.pop("type", None)) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(f"not a tracking message: {line.strip()[:80]!r}")
    if cls is Send:
        data["points"] = [Point(*p) for p in data["points"]]
    return cls(**data)


def points(step: int, values: dict, ts_ms: int, skip: tuple[str, ...] = ()) -> list[Point]:
    """Every number of a record as a point: whatever keys the objective reports reach MLflow.
    Bools and strings are not metrics; ``skip`` names bookkeeping fields (metrics.jsonl's step)."""
    return [
        Point(k, float(v), step, ts_ms)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip
    ]


LOG_FIELDS = ("step", "segment")  # metrics.jsonl's bookkeeping, not metrics


def logged_points(records: list[dict], after: int = 0, upto: int | None = None) -> list[Point]:
    """The points of metrics.jsonl's step records and eval events with ``after < step <= upto``
    (what a resume backfills, what an audit expects in the store); a later record of a step wins."""
    latest: dict[tuple[str, int], dict] = {}
    for r in records:
        step, kind = r.get("step"), r.get("event", "step")
        if kind not in ("step", "eval") or step is None:
            continue
        if after < step and (upto is None or step <= upto):
            latest[(kind, step)] = r
    now = now_ms()
    return [p for (_, s), r in latest.items() for p in points(s, r, now, skip=LOG_FIELDS)]


def now_ms() -> int:
    """A point's timestamp: wall-clock milliseconds, as MLflow stores them."""
    return int(time.time() * 1000)
