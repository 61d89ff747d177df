"""Are a job's run dirs in the MLflow store, with their metrics? Tracking warns and trains on when
its store fails, so a job that promises "every run is in mlruns.db" (the capstone) checks it after
the fact: each run dir must link to a run in the expected store that holds every point its
metrics.jsonl logged (one curve: each step once, whatever lifetime sent it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpulab.evidence.metrics import METRICS, read_records
from tpulab.tracking.protocol import logged_points
from tpulab.tracking.store import RUN_FILE, cause, open_store, read_run_link


@dataclasses.dataclass(frozen=True)
class RunAudit:
    run_dir: Path
    run_id: str | None
    steps: int  # distinct steps in metrics.jsonl
    problem: str | None  # None: the store holds the run and all its points


def run_dirs(root: Path, exclude: tuple[Path, ...] = ()) -> list[Path]:
    """Every run dir under ``root`` (a dir with a metrics.jsonl), outside the ``exclude`` trees."""
    found = (p.parent for p in Path(root).rglob(METRICS))
    return sorted(d for d in found if not any(d.is_relative_to(x) for x in exclude))


def audit_runs(dirs: list[Path], uri: str) -> list[RunAudit]:
    """One ``RunAudit`` per run dir, checked against the store at ``uri``."""
    client = None
    out = []
    for d in dirs:
        expected: dict[str, set[int]] = {}
        for p in logged_points(read_records(d)):
            expected.setdefault(p.key, set()).add(p.step)
        steps = len(expected.get("loss", set()))
        link = read_run_link(d)
        if link is None:
            out.append(RunAudit(d, None, steps, f"no {RUN_FILE}: no MLflow run was created"))
            continue
        run_id = link.get("run_id")
        if link.get("tracking_uri") != uri:
            out.append(RunAudit(d, run_id, steps, f"logged to {link.get('tracking_uri')}"))
            continue
        try:
            if client is None:
                client, _ = open_store(uri)
            client.get_run(run_id)
            missing = []
            for key, want in sorted(expected.items()):
                have = {m.step for m in client.get_metric_history(run_id, key)}
                if want - have:
                    missing.append(f"{key} at {len(want - have)} of {len(want)} steps")
            problem = "missing " + ", ".join(missing) if missing else None
        except Exception as e:  # noqa: BLE001 - a store that cannot answer: the run is not there
            problem = f"not readable in the store: {cause(e)}"
        out.append(RunAudit(d, run_id, steps, problem))
    return out
