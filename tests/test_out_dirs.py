"""Every command that takes ``--out`` refuses one already in use, in one line naming the first
file in the way, before any expensive work, and changes nothing there (``check_out``, the one
check); the few that may reuse one do so for a documented reason, tested here or beside the
command (merge-lora: tests/test_sft.py).

The refusals run in process (``run_main``). Where the command's other inputs are missing, a refusal
about ``--out`` shows the check came first; where they are real, reading the model is made to
fail, so a refusal shows nothing was read. The negative control: the same command with an empty
``--out`` gets past the check (and fails later, on the missing input or the model read)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, run_main
from tpulab.checkpoint.files import check_out, holds_only, json_with
from tpulab.errors import TpulabError


def snapshot(root):
    return sorted(
        (str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
        for p in root.rglob("*")
    )


def dir_commands(missing, run, out):
    """argv of every command whose ``--out`` is a directory; ``run``: a real trained run."""
    return {
        "merge-lora": ["merge-lora", "--run-dir", run, "--out", out],
        "export": ["export", "--run-dir", run, "--out", out],
        "kvcache": ["kvcache", "--run-dir", run, "--out", out],
        "reshard": ["reshard", "--run-dir", run, "--out", out, "--mesh", "data=3"],  # no such mesh
        "serve-bench": ["serve-bench", "--artifacts", missing, "--out", out],
        "image build": ["image", "build", "--artifacts", missing, "--out", out],
        "pairs": ["pairs", "--policy", missing, "--out", out],
        "posttrain": ["posttrain", "--sft", missing, "--out", out],
        "capstone": ["capstone", "--config", TINY, "--out", out],
        "dossier": ["dossier", "--config", TINY, "--out", out],
        "budget": ["budget", "--config", TINY, "--out", out],
        "receipt": ["receipt", "--out", out, "--matmul-size", "0"],
        "convert --from": ["convert", "--from", "torch", missing, "--out", out],
    }


def file_commands(missing, out):
    """argv of every command whose ``--out`` is a file."""
    return {
        "sft-eval": ["sft-eval", "--run-dir", missing, "--out", out],
        "win-rate": ["win-rate", "--run-dir", missing, "--against", missing, "--out", out],
        "contract record": ["contract", "record", "--data", missing, "--out", out],
        "convert --to": ["convert", "--run-dir", missing, "--to", "torch", "--out", out],
    }


@pytest.fixture
def no_work(monkeypatch):
    """The expensive work a refusal must come before (reading a model; the first step of the
    capstone, the dossier and the budget) fails here instead."""

    def began(*a, **k):
        raise TpulabError("the work began")

    for name in (
        "tpulab.train.restore.load_model",
        "tpulab.train.merge.load_model",
        "tpulab.orchestrate.capstone.write_child_config",
        "tpulab.orchestrate.dossier.Stages",
        "tpulab.perf.budget.budget",
    ):
        monkeypatch.setattr(name, began)


@pytest.mark.parametrize("command", list(dir_commands("m", "r", "o")))
def test_a_used_out_dir_is_refused_first_and_left_as_it_was(
    command, trained_run, tmp_path, capfd, no_work
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a_user_file.txt").write_text("keep me")
    (out / "config.yaml").write_text("mine: true\n")
    before = snapshot(tmp_path)
    argv = dir_commands(tmp_path / "missing", trained_run, out)[command]
    r = run_main(capfd, *argv)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --out {out} already exists and is not empty")
    assert "(a_user_file.txt is in the way)" in r.stderr
    assert snapshot(tmp_path) == before
    # negative control: an empty --out gets past the check, to the missing input or the work
    (out / "a_user_file.txt").unlink()
    (out / "config.yaml").unlink()
    r = run_main(capfd, *argv)
    assert r.returncode != 0 and "in the way" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", list(file_commands("m", "o")))
def test_an_existing_out_file_is_refused_first_and_left_as_it_was(command, tmp_path, capfd):
    out = tmp_path / "out.json"
    out.write_text('{"mine": true}\n')
    before = snapshot(tmp_path)
    r = run_main(capfd, *file_commands(tmp_path / "missing", out)[command])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --out {out} already exists (a file) and is never overwrit")
    assert snapshot(tmp_path) == before
    out.unlink()  # negative control: a new path gets past the check
    r = run_main(capfd, *file_commands(tmp_path / "missing", out)[command])
    assert r.returncode != 0 and "never overwritten" not in r.stderr, r.stderr


def test_the_reuse_rules_take_only_the_commands_own_results(tmp_path):
    # kvcache (default RUN_DIR/kvcache) and budget (default runs/budget) rewrite their own report
    kv = tmp_path / "kvcache"
    kv.mkdir()
    for name in ("kvcache.json", "kvcache.md", "kvcache.png"):
        (kv / name).write_text("{}")
    mine = holds_only("kvcache.json", "kvcache.md", "kvcache.png")
    assert check_out(kv, reuse=mine) == kv
    (kv / "notes.txt").write_text("mine")
    with pytest.raises(TpulabError, match=r"\(kvcache.json is in the way\)"):
        check_out(kv, reuse=mine)
    # sft-eval and win-rate replace their own earlier record, never another JSON
    record = tmp_path / "win.json"
    record.write_text(json.dumps({"policy": {}, "against": {}, "win_rate": 0.5}))
    assert check_out(record, file=True, reuse=json_with("policy", "against", "win_rate"))
    record.write_text(json.dumps({"win_rate": 0.5}))
    with pytest.raises(TpulabError, match="never overwritten"):
        check_out(record, file=True, reuse=json_with("policy", "against", "win_rate"))
    record.write_text("not json")
    with pytest.raises(TpulabError, match="never overwritten"):
        check_out(record, file=True, reuse=json_with("win_rate"))


def test_a_receipt_dir_takes_the_other_processes_receipts_only(tmp_path):
    from tpulab.evidence.receipt import _only_receipts

    d = tmp_path / "receipt"
    d.mkdir()
    for name in ("receipt-p0.json", "receipt-p0.md", ".receipt-p1.json.tmp-123"):
        (d / name).write_text("{}")
    (d / "launch").mkdir()  # `tpulab launch -- receipt --out D` keeps its logs in D/launch
    assert check_out(d, reuse=_only_receipts) == d
    (d / "receipt.json.bak").write_text("{}")
    with pytest.raises(TpulabError, match="in the way"):
        check_out(d, reuse=_only_receipts)


def test_reshard_under_launch_takes_its_own_log_dir_only(trained_run, tmp_path, capfd):
    out = tmp_path / "out"
    (out / "launch").mkdir(parents=True)
    r = run_main(capfd, "reshard", "--run-dir", trained_run, "--out", out, "--mesh", "data=3")
    assert "in the way" not in r.stderr  # past the check: the impossible mesh is the error
    (out / "launch.txt").write_text("mine")
    r = run_main(capfd, "reshard", "--run-dir", trained_run, "--out", out, "--mesh", "data=3")
    assert r.returncode == 2 and "(launch is in the way)" in r.stderr
