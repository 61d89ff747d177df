"""The data checks read what the run consumed (its window ledger), so planted leaks, gaps and
corrupt lines make them fail."""

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
COVERED = "data: the window ledger records every step and batch row, readably"


def _rows(run_dir):
    splits = build_splits(load_corpus(None), tiny_config().data)
    recorded = json.loads((run_dir / "documents.json").read_text())
    rows = check_disjoint(splits, recorded, read_ledger(run_dir), steps=40, batch_size=8)
    return splits, {r["check"]: r for r in rows}


def _ledger_lines(run):
    return (run / "windows.p0.jsonl").read_text().splitlines(keepends=True)


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


@pytest.mark.parametrize("gap", ["a step missing", "a batch row missing"])
def test_an_incomplete_ledger_fails(trained_run, tmp_path, gap):
    """What was not recorded was not checked: a ledger without step 17 (or with one row of step 23
    missing) must fail, though every window it does hold is a clean training window."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    _, before = _rows(run)
    assert before[COVERED]["passed"], before[COVERED]["detail"]
    lines = _ledger_lines(run)
    if gap == "a step missing":
        lines = [x for x in lines if json.loads(x).get("step") != 17]
    else:
        i = next(i for i, x in enumerate(lines) if json.loads(x).get("step") == 23)
        rec = json.loads(lines[i])
        lines[i] = json.dumps({**rec, "train": rec["train"][:-1]}) + "\n"
    (run / "windows.p0.jsonl").write_text("".join(lines))
    _, after = _rows(run)
    assert not after[COVERED]["passed"] and after[DRAWN]["passed"], after[COVERED]["detail"]
    assert ("[17]" if gap == "a step missing" else "[23]") in after[COVERED]["detail"]


def test_a_corrupt_line_fails_and_a_torn_one_does_not(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    lines = _ledger_lines(run)
    i = next(i for i, x in enumerate(lines) if json.loads(x).get("step") == 12)
    # a kill tears the last line a lifetime wrote: the file's last line, or the one before the next
    # lifetime's eval record (WindowLedger starts a fresh line after a torn one)
    torn = lines[:i] + [lines[i][:40] + "\n"] + lines[:1] + lines[i:]
    torn.append('{"step": 41, "train": ["0a1b')  # and a last line cut short
    (run / "windows.p0.jsonl").write_text("".join(torn))
    ledger = read_ledger(run)
    assert ledger["torn"] == [f"windows.p0.jsonl:{i + 1}", f"windows.p0.jsonl:{len(torn)}"]
    assert ledger["corrupt"] == []
    _, rows = _rows(run)
    assert rows[COVERED]["passed"], rows[COVERED]["detail"]
    # a line broken in the middle of a lifetime is no tear: corruption, reported and failed
    broken = list(lines)
    broken[i] = broken[i][:40] + "\n"
    (run / "windows.p0.jsonl").write_text("".join(broken))
    ledger = read_ledger(run)
    assert ledger["corrupt"] == [f"windows.p0.jsonl:{i + 1}"] and ledger["torn"] == []
    _, rows = _rows(run)
    assert not rows[COVERED]["passed"] and f"windows.p0.jsonl:{i + 1}" in rows[COVERED]["detail"]


def test_the_ledger_starts_a_fresh_line_after_a_torn_one(tmp_path):
    from tpulab.evidence.ledger import WindowLedger

    (tmp_path / "windows.p0.jsonl").write_text('{"eval": []}\n{"step": 1, "tra')  # killed mid-line
    ledger = WindowLedger(tmp_path)
    w = np.arange(2 * 33, dtype=np.int32).reshape(2, 33)
    batch = {"inputs": w[:, :-1], "targets": w[:, 1:], "mask": np.array([[1.0] * 32, [0.0] * 32])}
    ledger.record_eval([batch])
    ledger.record_train(1, batch)
    ledger.close()
    got = read_ledger(tmp_path)
    assert got["torn"] == ["windows.p0.jsonl:2"] and got["corrupt"] == []
    assert got["eval"] == set(window_sha256(w[:1]))  # the all-padding row is no window
    assert got["train"] == {1: window_sha256(w)}
