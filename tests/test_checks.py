"""The data checks read what the run consumed (its window ledger), so planted leaks make them fail."""

import json
import shutil

import numpy as np
import pytest

from conftest import tiny_config
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits
from tpulab.evidence.ledger import read_ledger, window_sha256
from tpulab.proofs.checks import check_disjoint, run_checks

DRAWN = "data: no validation window was drawn for training (run's window ledger, sha256)"
EVAL = "data: validation loss read validation windows only (run's window ledger)"


def _rows(run_dir):
    splits = build_splits(load_corpus(None), tiny_config().data)
    recorded = json.loads((run_dir / "documents.json").read_text())
    return splits, {r["check"]: r for r in check_disjoint(splits, recorded, read_ledger(run_dir))}


def test_every_check_passes_on_a_clean_run_and_reads_the_ledger(trained_run):
    results = run_checks(tiny_config(), run_dir=trained_run)
    assert all(r["passed"] for r in results), [r for r in results if not r["passed"]]
    ledger = read_ledger(trained_run)
    assert sorted(ledger["train"]) == list(range(1, 41)) and all(
        len(h) == 8 for h in ledger["train"].values()
    )
    assert len(ledger["eval"]) > 0
    assert "cut points t = " in results[0]["detail"]


@pytest.mark.parametrize(
    "leak", ["validation window in a training batch", "training window in an eval batch"]
)
def test_a_planted_leak_fails_its_check(trained_run, tmp_path, leak):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    splits, before = _rows(run)
    assert before[DRAWN]["passed"] and before[EVAL]["passed"]
    val_window = window_sha256(splits.val_windows[:1])[0]
    train_window = window_sha256(splits.train_windows[:1])[0]
    with open(run / "windows.p0.jsonl", "a") as f:
        if leak.startswith("validation"):
            f.write(json.dumps({"step": 41, "train": [val_window] + [train_window] * 7}) + "\n")
        else:
            f.write(json.dumps({"eval": [train_window]}) + "\n")
    _, after = _rows(run)
    failed = DRAWN if leak.startswith("validation") else EVAL
    kept = EVAL if failed == DRAWN else DRAWN
    assert not after[failed]["passed"] and after[kept]["passed"], after[failed]["detail"]


def test_a_run_that_recorded_nothing_fails(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for f in run.glob("windows.p*.jsonl"):
        f.unlink()
    _, rows = _rows(run)
    assert not rows[DRAWN]["passed"] and not rows[EVAL]["passed"]
    assert "recorded no" in rows[DRAWN]["detail"]


def test_window_hash_is_sha256_of_the_int32_window():
    import hashlib

    w = np.arange(33, dtype=np.int32)[None]
    assert window_sha256(w) == [hashlib.sha256(w[0].tobytes()).hexdigest()[:32]]
