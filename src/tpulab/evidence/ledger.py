"""What a run actually consumed: sha256 of every training window drawn and every evaluation window read.

The data checks compare these records with the validation documents instead of rebuilding the split
and comparing it with itself, so a leak in what the loop really fed the model (a validation window in a
training batch, a training window in an evaluation batch) makes them fail. One file per process
(``windows.p<index>.jsonl``): ``{"eval": [...]}`` once per process lifetime, then ``{"step": s, "train":
[...]}`` per step; a step redone after a resume appears again with the same hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

PATTERN = "windows.p*.jsonl"


def window_sha256(windows: np.ndarray) -> list[str]:
    """sha256 (first 32 hex digits) of each [seq_len + 1] int32 window's bytes."""
    rows = np.ascontiguousarray(np.asarray(windows, dtype=np.int32))
    return [hashlib.sha256(r.tobytes()).hexdigest()[:32] for r in rows]


def batch_windows(batch: dict) -> np.ndarray:
    """The full windows of a batch: inputs plus each row's last target."""
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


class WindowLedger:
    def __init__(self, run_dir: str | Path, process_index: int = 0):
        self._f = open(Path(run_dir) / f"windows.p{process_index}.jsonl", "a", buffering=1)

    def record_eval(self, batches: list[dict]) -> None:
        hashes = [h for b in batches for h in window_sha256(batch_windows(b))]
        self._f.write(json.dumps({"eval": hashes}) + "\n")

    def record_train(self, step: int, batch: dict) -> None:
        self._f.write(
            json.dumps({"step": int(step), "train": window_sha256(batch_windows(batch))}) + "\n"
        )

    def close(self) -> None:
        self._f.close()


def read_ledger(run_dir: str | Path) -> dict:
    """{"train": {step: [hashes of all processes]}, "eval": set of hashes, "files": n}. Torn lines are skipped."""
    train: dict[int, list[str]] = {}
    evals: set[str] = set()
    files = sorted(Path(run_dir).glob(PATTERN))
    for path in files:
        per_file: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "eval" in rec:
                evals.update(rec["eval"])
            elif "train" in rec:
                per_file[rec["step"]] = rec["train"]  # a redone step: the later record wins
        for step, hashes in per_file.items():
            train.setdefault(step, []).extend(hashes)
    return {"train": train, "eval": evals, "files": len(files)}
