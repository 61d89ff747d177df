"""The run directory's one interface: typed paths and the one JSON reader."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from conftest import tiny_config
from tpulab.checkpoint import files
from tpulab.checkpoint import rundir as R
from tpulab.checkpoint.rundir import RunDir, read_json, write_config, write_json


def test_paths_are_the_names_the_layers_used(tmp_path):
    run = RunDir(tmp_path)
    assert run.config == tmp_path / "config.yaml"
    assert run.env == tmp_path / "env.json"
    assert run.documents == tmp_path / "documents.json"
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert run.summary == tmp_path / "summary.json"
    assert run.goodput == tmp_path / "goodput.json"
    assert run.mlflow_run == tmp_path / "mlflow_run.json"
    assert run.windows(3) == tmp_path / "windows.p3.jsonl"
    assert run.checkpoints == tmp_path / "checkpoints"
    assert run.rejected_checkpoints == tmp_path / "rejected_checkpoints"
    assert run.manifest(20) == tmp_path / "checkpoints" / "20" / "tpulab_manifest.json"
    assert R.MANIFEST is files.MANIFEST
    proof = run.proof
    assert isinstance(proof, RunDir) and proof.root == tmp_path / "proof"
    assert proof.interrupted.checkpoints == tmp_path / "proof" / "interrupted" / "checkpoints"
    assert proof.reference.metrics == tmp_path / "proof" / "reference" / "metrics.jsonl"
    assert proof.verdict == tmp_path / "proof" / "verdict.json"
    assert run.chaos.victim.root == tmp_path / "chaos" / "victim"
    assert run.chaos.verdict == tmp_path / "chaos" / "verdict.json"
    # a RunDir goes where a path goes, and reads the same in messages
    assert Path(run) == tmp_path and os.fspath(run) == str(tmp_path) and f"{run}" == str(tmp_path)
    assert RunDir(str(tmp_path)) == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.root = tmp_path / "other"


def test_window_files_are_every_process_ledger_in_order(tmp_path):
    run = RunDir(tmp_path)
    for i in (1, 0, 10):
        run.windows(i).write_text("")
    (tmp_path / "windows.json").write_text("")  # not a ledger
    assert [p.name for p in run.window_files()] == [
        "windows.p0.jsonl",
        "windows.p1.jsonl",
        "windows.p10.jsonl",
    ]


def test_read_json_reads_defaults_and_refuses(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"a": [1, 2]})
    assert read_json(path) == {"a": [1, 2]}
    assert json.loads(path.read_text()) == {"a": [1, 2]}  # the same bytes any reader sees
    assert not list(tmp_path.glob(".*tmp*")), "the atomic write leaves no temp file"
    assert read_json(tmp_path / "absent.json", None) is None
    assert read_json(tmp_path / "absent.json", {}) == {}
    with pytest.raises(FileNotFoundError):  # negative control: no default, no silent None
        read_json(tmp_path / "absent.json")
    path.write_text('{"a": ')
    with pytest.raises(ValueError):  # a torn record is never read as missing
        read_json(path, None)


def test_run_dir_records_round_trip(tmp_path):
    run = RunDir(tmp_path)
    assert run.write(R.VERDICT, {"passed": True}) == run.verdict
    assert run.read(R.VERDICT) == {"passed": True}
    assert run.read(R.SUMMARY, None) is None
    with pytest.raises(FileNotFoundError):
        run.read(R.SUMMARY)


def test_written_config_loads_back_as_the_same_config(tmp_path):
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    config = tiny_config("train.steps=7")
    path = RunDir(tmp_path).write_config(config)
    assert path == tmp_path / "config.yaml"
    assert load(RunConfig, path) == config
    other = tiny_config("train.steps=8")  # negative control: a different config reads different
    assert load(RunConfig, write_config(tmp_path / "o.yaml", other)) != config
