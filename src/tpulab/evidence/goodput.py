"""Goodput: where the wall time of a run went, over every process lifetime, the killed ones
included.

Input is only the run dir's metrics.jsonl (one ``start`` record per process lifetime, step records
with ``wall_s`` since that process entered ``train()``, ``eval`` events, and an ``end`` event with
the loop's ``phases_s`` when the lifetime ended normally). Buckets:

- productive: step time of steps that count (each step once)
- startup_compile: the first process's start-up (corpus, init) and first step (XLA compile)
- data, eval, checkpoint: time the loop waited for batches, validation, checkpoint saves
- restart_startup: start-up, restore and first step of every resumed process
- redone_steps: steps a killed process trained beyond the checkpoint the next process resumed from
- kill_tail: time between a killed process's last record and the kill (known only from the driver)

goodput = productive / total, where total is the measured wall time (each lifetime's ``end``
event's ``wall_s``, or its last record's, plus the kill tail), not the buckets' sum;
``unaccounted_s`` is what the buckets leave of it (a few ms between the loop's last phase lap and
its end event). A killed lifetime has no ``end`` event: its time is split from the gaps between its
step records (the median gap is step time; the excess of a gap around an eval or a checkpoint step
goes to eval or checkpoint; data waiting cannot be told apart there and stays in the step time),
and it ends at its last record. Process start-up before ``train()`` (Python imports) is in no
bucket.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from tpulab.checkpoint.rundir import RunDir
from tpulab.evidence.metrics import read_records, starts
from tpulab.evidence.report_kit import table

BUCKETS = (
    "productive",
    "startup_compile",
    "data",
    "eval",
    "checkpoint",
    "restart_startup",
    "redone_steps",
    "kill_tail",
)
RESTART = ("restart_startup", "redone_steps", "kill_tail")


def _save_every(run_dir: Path) -> int | None:
    try:
        return int(yaml.safe_load(RunDir(run_dir).config.read_text())["checkpoint"]["save_every"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def account(records: list[dict], save_every: int | None = None, kill_tail_s: float = 0.0) -> dict:
    """The arithmetic, on parsed records (see the module docstring). ``kill_tail_s``: time the
    driver saw killed processes live beyond what their records show (chaos: kill moments minus
    logged time)."""
    segments = starts(records)
    totals = dict.fromkeys(BUCKETS, 0.0)
    lifetimes, walls = [], []
    for i, start in enumerate(segments):
        seg = start["segment"]
        resumed = start.get("resumed_from") is not None
        steps = [
            r
            for r in records
            if r.get("segment") == seg and "step" in r and "wall_s" in r and "event" not in r
        ]
        evals = {r["step"] for r in records if r.get("segment") == seg and r.get("event") == "eval"}
        end = next(
            (r for r in records if r.get("segment") == seg and r.get("event") == "end"), None
        )
        nxt = segments[i + 1].get("resumed_from") if i + 1 < len(segments) else None
        nxt = (
            0 if (i + 1 < len(segments) and nxt is None) else nxt
        )  # next process started from scratch
        b = dict.fromkeys(BUCKETS, 0.0)
        gaps = [(a["step"], c["step"], c["wall_s"] - a["wall_s"]) for a, c in zip(steps, steps[1:])]
        med = statistics.median([d for _, _, d in gaps]) if gaps else 0.0
        split = []  # (step the gap ends at, step time, excess, bucket of the excess)
        for s0, s1, d in gaps:
            extra = max(0.0, d - med)
            if any(s0 <= e < s1 for e in evals):
                split.append((s1, d - extra, extra, "eval"))
            elif save_every and any(s % save_every == 0 for s in range(s0, s1)):
                split.append((s1, d - extra, extra, "checkpoint"))
            else:
                split.append((s1, d, 0.0, None))
        first_counted = (
            min(med, steps[0]["wall_s"]) if steps else 0.0
        )  # the first logged step's own time
        redone = sum(base for s1, base, _, _ in split if nxt is not None and s1 > nxt)
        if (
            nxt is not None and steps and steps[0]["step"] > nxt
        ):  # even the first logged step was thrown away
            redone += first_counted
        first_bucket = "restart_startup" if resumed else "startup_compile"
        if end is not None:
            ph = end.get("phases_s", {})
            total = float(end.get("wall_s", sum(ph.values())))
            b[first_bucket] = ph.get("startup", 0.0) + ph.get("first_step", 0.0)
            for k in ("data", "eval", "checkpoint"):
                b[k] = ph.get(k, 0.0)
            b["redone_steps"] = min(redone, ph.get("step", 0.0))
            b["productive"] = ph.get("step", 0.0) - b["redone_steps"]
        else:
            total = steps[-1]["wall_s"] if steps else 0.0
            b[first_bucket] = max(0.0, steps[0]["wall_s"] - med) if steps else 0.0
            b["productive"] = first_counted + sum(base for _, base, _, _ in split)
            for _, _, extra, bucket in split:
                if bucket:
                    b[bucket] += extra
            b["redone_steps"] = min(redone, b["productive"])
            b["productive"] -= b["redone_steps"]
        for k in BUCKETS:
            totals[k] += b[k]
        walls.append(total)
        lifetimes.append(
            {
                "segment": seg,
                "resumed_from": start.get("resumed_from"),
                "ended": end is not None,
                "steps_logged": len(steps),
                "first_step": steps[0]["step"] if steps else None,
                "last_step": steps[-1]["step"] if steps else None,
                "total_s": round(total, 4),
                "buckets_s": {k: round(v, 4) for k, v in b.items() if v},
            }
        )
    totals["kill_tail"] += max(0.0, kill_tail_s)
    # The wall time as measured (each lifetime's end event, or its last record, plus the kill tail),
    # not the buckets' own sum: what the buckets fail to cover shows up as unaccounted.
    total = sum(walls) + max(0.0, kill_tail_s)
    return {
        "total_s": round(total, 4),
        "goodput": (totals["productive"] / total) if total > 0 else 0.0,
        "buckets_s": {k: round(v, 4) for k, v in totals.items()},
        "unaccounted_s": round(total - sum(totals.values()), 4),
        "restart_s": round(sum(totals[k] for k in RESTART), 4),
        "lifetimes": lifetimes,
        "killed_lifetimes": sum(1 for lt in lifetimes if not lt["ended"]),
    }


def goodput(run_dir: str | Path, kill_tail_s: float = 0.0) -> dict:
    run_dir = Path(run_dir)
    out = account(read_records(run_dir), _save_every(run_dir), kill_tail_s)
    out["run_dir"] = str(run_dir)
    return out


def chaos_kill_tail(victim: str | Path, kill_log: list[dict]) -> float:
    """Time the chaos driver saw its killed processes live beyond their last metrics record: the
    sum of kill moments (seconds after each start) minus the logged time of the killed lifetimes.
    Includes lifetimes killed before they wrote any record and the Python start-up of each killed
    process."""
    g = account(read_records(victim), _save_every(Path(victim)))
    logged = sum(lt["total_s"] for lt in g["lifetimes"] if not lt["ended"])
    return max(0.0, sum(float(k.get("at_s", 0.0)) for k in kill_log) - logged)


LABELS = {
    "productive": "productive steps",
    "startup_compile": "start-up and first step (compile)",
    "data": "waiting for data",
    "eval": "evaluation",
    "checkpoint": "checkpoint saves (blocking)",
    "restart_startup": "restart: start-up, restore, first step of resumed processes",
    "redone_steps": "restart: steps redone after a resume",
    "kill_tail": "restart: killed after the last record",
    "unaccounted": "in no bucket (measured wall time minus the buckets)",
}


def markdown(g: dict, title: str = "Goodput") -> str:
    shown = {**g["buckets_s"], "unaccounted": g.get("unaccounted_s", 0.0)}
    rows = [
        (LABELS[k], f"{v:.2f} s", f"{100 * v / g['total_s']:.1f}%")
        for k, v in shown.items()
        if g["total_s"] > 0 and (v > 0 or k == "productive" or (k == "unaccounted" and v))
    ]
    return "\n".join(
        [
            f"### {title}",
            "",
            f"**goodput {100 * g['goodput']:.1f}%** (productive step time / wall time) over "
            f"{len(g['lifetimes'])} process lifetime(s), {g['killed_lifetimes']} of them killed; "
            f"wall time {g['total_s']:.2f} s, of which {g['restart_s']:.2f} s lost to restarts.",
            "",
            table(["where the time went", "seconds", "share"], rows),
            "",
            "Killed lifetimes are split from their step records (no end event); Python start-up "
            "before `train()` is not counted.",
        ]
    )
