"""What a run consumed: sha256 of every training window drawn and every evaluation window read.

The data checks compare these records with the validation documents instead of rebuilding the split
and comparing it with itself, so a leak in what the loop really fed the model (a validation window
in a training batch, a training window in an evaluation batch) makes them fail. One file per process
(``windows.p<index>.jsonl``): ``{"eval": [...]}`` once per process lifetime, then ``{"step": s,
"train": [...]}`` per step; a step redone after a resume appears again with the same hashes. A kill
can tear only the last line a lifetime wrote: the next lifetime starts on a fresh line, so a torn
line is the file's last or the one before a lifetime's ``eval`` record; any other unreadable line is
corruption, and the reader reports it.

What identifies a row is the objective's (``DataSource.row_ids``/``eval_row_ids``); the default is
the byte-LM window's sha256 (``window_ids``, ``eval_window_ids``), which the independent checks
compare with the validation documents: disjoint splits, no foreign windows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tpulab.checkpoint.rundir import RunDir


def window_sha256(windows: np.ndarray) -> list[str]:
    """sha256 (first 32 hex digits) of each [seq_len + 1] int32 window's bytes."""
    rows = np.ascontiguousarray(np.asarray(windows, dtype=np.int32))
    return [hashlib.sha256(r.tobytes()).hexdigest()[:32] for r in rows]


def batch_windows(batch: dict) -> np.ndarray:
    """The full windows of a batch: inputs plus each row's last target (a batch without targets,
    PPO's prompts, is its inputs)."""
    if "targets" not in batch:
        return np.asarray(batch["inputs"])
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


def window_ids(batch: dict) -> list[str]:
    """The byte-LM default identity of each training row: its full window's sha256."""
    return window_sha256(batch_windows(batch))


def eval_window_ids(batch: dict) -> list[str]:
    """Each evaluation row's window sha256; rows with no valid target (a partial last batch's
    padding) are no window: left out."""
    used = np.asarray(batch["mask"]).any(axis=1)
    return [h for h, u in zip(window_ids(batch), used) if u]


class WindowLedger:
    def __init__(
        self,
        run_dir: str | Path,
        process_index: int = 0,
        row_ids: Callable[[dict], list[str]] = window_ids,
        eval_row_ids: Callable[[dict], list[str]] = eval_window_ids,
    ):
        self._row_ids, self._eval_row_ids = row_ids, eval_row_ids
        path = RunDir(run_dir).windows(process_index)
        self._f = open(path, "a", buffering=1)
        if self._f.tell() > 0:
            with open(path, "rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":  # a kill tore the last line: keep its fragment on its own
                    self._f.write("\n")

    def record_eval(self, batches: list[dict]) -> None:
        hashes = [h for b in batches for h in self._eval_row_ids(b)]
        self._f.write(json.dumps({"eval": hashes}) + "\n")

    def record_train(self, step: int, batch: dict) -> None:
        """An empty batch (an objective whose state carries its data) is a step with no rows."""
        rows = self._row_ids(batch) if batch else []
        self._f.write(json.dumps({"step": int(step), "train": rows}) + "\n")

    def close(self) -> None:
        self._f.close()


def _parse(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(rec, dict) and (
        isinstance(rec.get("eval"), list)
        or (isinstance(rec.get("step"), int) and isinstance(rec.get("train"), list))
    )
    return rec if ok else None


def read_ledger(run_dir: str | Path) -> dict:
    """{"train": {step: [hashes of all processes]}, "eval": set of hashes, "files": n,
    "per_process": [{step: [hashes]} per file], "torn": [where], "corrupt": [where]}; ``where`` is
    ``file:line``. Torn lines (see the module docstring) are skipped; corrupt ones are skipped and
    listed, for the checks to fail on."""
    train: dict[int, list[str]] = {}
    evals: set[str] = set()
    per_process: list[dict[int, list[str]]] = []
    torn: list[str] = []
    corrupt: list[str] = []
    files = RunDir(run_dir).window_files()
    for path in files:
        per_file: dict[int, list[str]] = {}
        lines = path.read_text().splitlines()
        parsed = [_parse(line) for line in lines]
        for i, (line, rec) in enumerate(zip(lines, parsed)):
            if rec is None:
                if not line.strip():
                    continue
                last_of_lifetime = i + 1 == len(lines) or (
                    parsed[i + 1] is not None and "eval" in parsed[i + 1]
                )
                (torn if last_of_lifetime else corrupt).append(f"{path.name}:{i + 1}")
            elif "eval" in rec:
                evals.update(rec["eval"])
            else:
                per_file[rec["step"]] = rec["train"]  # a redone step: the later record wins
        for step, hashes in per_file.items():
            train.setdefault(step, []).extend(hashes)
        per_process.append(per_file)
    return {
        "train": train,
        "eval": evals,
        "files": len(files),
        "per_process": per_process,
        "torn": torn,
        "corrupt": corrupt,
    }


def coverage(ledger: dict, steps: int, rows: int) -> dict:
    """Steps 1..``steps`` each with exactly ``rows`` recorded windows (over all processes)."""
    missing = [s for s in range(1, steps + 1) if s not in ledger["train"]]
    short = [
        s for s in range(1, steps + 1) if s in ledger["train"] and len(ledger["train"][s]) != rows
    ]
    return {
        "missing_steps": missing,
        "wrong_row_count_steps": short,
        "complete": not (missing or short),
    }
