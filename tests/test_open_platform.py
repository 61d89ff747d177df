"""The platform is open: objectives defined in tests/open_objectives.py, outside ``src/``, named by
import path (``objective.kind: open_objectives:Digits``), go through ``tpulab train``,
``prove-resume``, ``chaos``, ``launch`` with 2 processes, MLflow tracking and the report, as the
built-in ones do. Every child is a real ``tpulab`` process that imports the objective again from
``tests/`` on its PYTHONPATH (what the proof driver passes on: the parent's environment)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, TINY, run_cli

pytestmark = pytest.mark.slow

DIGITS, COUNTER = "open_objectives:Digits", "open_objectives:Counter"


def _env(tmp_path: Path) -> dict:
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}


def _cli(tmp_path: Path, *args: str, timeout: float = 600):
    return run_cli(*args, env=_env(tmp_path), timeout=timeout)


def _config(kind: str, where: Path) -> Path:
    """configs/tiny.yaml with ``objective.kind``; for Digits its own model family in place of the
    Transformer's section (a config file, as a user would write one)."""
    config = yaml.safe_load(TINY.read_text())
    config["objective"] = {"kind": kind}
    if kind == DIGITS:
        config["model"] = {"family": "open_objectives:MLPConfig", "hidden": 32}
    path = where / f"{kind.replace(':', '-')}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _config_args(kind: str, where: Path, *sets: str) -> list[str]:
    return ["--config", str(_config(kind, where)), *(x for s in sets for x in ("--set", s))]


def _losses(run: Path) -> dict[int, float]:
    from tpulab.evidence.metrics import read_records

    return {r["step"]: r["loss"] for r in read_records(run) if "loss" in r}


@pytest.fixture(scope="module")
def digits_proof(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("digits")
    out = _cli(
        d, "prove-resume", *_config_args(DIGITS, d), "--run-dir", str(d / "proof"), "--no-track"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return d / "proof"


def test_digits_trains_through_the_cli_with_its_own_model_facts_and_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    from tpulab import load_model

    run = tmp_path / "run"
    out = _cli(
        tmp_path,
        "train",
        *_config_args(DIGITS, tmp_path, "model.hidden=24"),
        "--run-dir",
        str(run),
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    env = json.loads((run / "env.json").read_text())
    assert env["objective"] == DIGITS
    assert env["shapes"] == {"batch": 8, "features": 64, "hidden": 24, "classes": 10}
    assert env["work"] == {"unit": "images", "per_step": 8}
    assert env["param_count"] == 64 * 24 + 24 + 24 * 10 + 10  # the MLP's, not a Transformer's
    assert "d_model" not in env["shapes"]
    # the child config carries the import path and the kind's own section
    saved = yaml.safe_load((run / "config.yaml").read_text())["objective"]
    assert saved["kind"] == DIGITS and saved["digits"] == {"train_images": 1500}
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert model == {"family": "open_objectives:MLPConfig", "hidden": 24}
    # load_model asks the objective: the state and model it describes, from the checkpoint

    sys.path.insert(0, str(REPO / "tests"))
    try:
        from open_objectives import MLP, N_TRAIN, _digits

        restored = load_model(run)
        assert isinstance(restored.model, MLP) and restored.step == 40
        x, y = _digits()
        accuracy = float((np.asarray(restored.model(x[N_TRAIN:])).argmax(-1) == y[N_TRAIN:]).mean())
        assert accuracy > 0.2  # 10 classes: 0.1 is chance; trained 40 steps of 8 images
    finally:
        sys.path.remove(str(REPO / "tests"))
    # the window ledger holds the objective's row identities: 8 image rows a step
    lines = [json.loads(line) for line in (run / "windows.p0.jsonl").read_text().splitlines()]
    assert all(len(r["train"]) == 8 for r in lines if "train" in r)
    # tracking: one MLflow run with every step's loss
    link = json.loads((run / "mlflow_run.json").read_text())
    client = MlflowClient(tracking_uri=_env(tmp_path)["MLFLOW_TRACKING_URI"])
    hist = client.get_metric_history(link["run_id"], "loss")
    assert sorted(m.step for m in hist) == list(range(1, 41))
    assert client.get_run(link["run_id"]).data.params["objective.kind"] == DIGITS


def test_digits_prove_resume_is_bitwise_and_the_report_reads_its_facts(digits_proof, tmp_path):
    v = json.loads((digits_proof / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["curves_identical"] and v["final_state_identical"]
    assert v["steps_redone"] > 0 and v["data_position_files"] == 1
    assert "Grain data position" in v["final_state_compared"]
    out = _cli(tmp_path, "report", "--run-dir", str(digits_proof), "--no-track")
    assert out.returncode == 0, out.stderr
    report = (digits_proof / "report.md").read_text()
    assert f"`{DIGITS}`" in report and "images/s" in report and "**bitwise identical**" in report


def test_a_skipped_state_leaf_fails_the_digits_verdict(digits_proof, tmp_path):
    """Negative control: the resume restores every leaf but the RNG key, which the MLP never reads
    (its loss curve stays equal): the whole-state verdict must still fail, on that leaf."""
    out = _cli(
        tmp_path,
        "prove-resume",
        *_config_args(DIGITS, tmp_path),
        "--run-dir",
        str(tmp_path / "proof"),
        "--reference",
        str(digits_proof / "proof" / "reference"),
        "--skip-restore",
        "rng",
        "--no-track",
    )
    assert out.returncode != 0, out.stdout
    v = json.loads((tmp_path / "proof" / "proof" / "verdict.json").read_text())
    assert v["curves_identical"] and not v["final_state_identical"]
    assert "rng" in v["first_differing_leaf"]


def test_digits_survives_chaos(digits_proof, tmp_path):
    out = _cli(
        tmp_path,
        "chaos",
        *_config_args(DIGITS, tmp_path),
        "--run-dir",
        str(tmp_path / "chaos"),
        "--kills",
        "2",
        "--reference",
        str(digits_proof / "proof" / "reference"),
        "--no-track",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    v = json.loads((tmp_path / "chaos" / "chaos" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"]


def test_digits_launch_with_2_processes_splits_each_batch(digits_proof, tmp_path):
    run = tmp_path / "run"
    out = _cli(
        tmp_path,
        "launch",
        "--processes",
        "2",
        "--",
        "train",
        *_config_args(DIGITS, tmp_path),
        "--run-dir",
        str(run),
        "--no-progress",
        "--no-track",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    env = json.loads((run / "env.json").read_text())
    assert env["process_count"] == 2
    rows = [
        {
            r["step"]: r["train"]
            for r in map(json.loads, (run / f"windows.p{i}.jsonl").open())
            if "train" in r
        }
        for i in (0, 1)
    ]
    # each process fed its own 4 rows of each 8-row batch: disjoint, together the 1-process batch
    reference = {
        r["step"]: r["train"]
        for r in map(json.loads, (digits_proof / "proof" / "reference" / "windows.p0.jsonl").open())
        if "train" in r
    }
    for step in range(1, 41):
        assert len(rows[0][step]) == len(rows[1][step]) == 4
        assert sorted(rows[0][step] + rows[1][step]) == sorted(reference[step])
    one, two = _losses(digits_proof / "proof" / "reference"), _losses(run)
    assert np.allclose([one[s] for s in range(1, 41)], [two[s] for s in range(1, 41)], rtol=1e-5)


def test_counter_has_no_data_iterator_and_its_resume_is_proven_on_the_state_alone(tmp_path):
    from tpulab.checkpoint.store import read_meta

    proof = tmp_path / "proof"
    out = _cli(
        tmp_path,
        "prove-resume",
        *_config_args(COUNTER, tmp_path),
        "--run-dir",
        str(proof),
        "--no-track",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    v = json.loads((proof / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"] and v["data_position_files"] == 0
    assert v["final_state_compared"].endswith("counter")  # the state's data, compared with the rest
    assert "Grain" not in v["final_state_compared"]
    step_dir = proof / "proof" / "interrupted" / "checkpoints" / "40"
    assert read_meta(step_dir)["data_position"] is False and not (step_dir / "data").exists()
    counters = [
        r["counter"]
        for r in map(json.loads, (proof / "proof" / "reference" / "metrics.jsonl").open())
        if "counter" in r
    ]
    assert len(set(counters)) > 30  # the data moved: a new counter (almost) every step
    # negative control: the resume drops the RNG key, and the verdict names it
    bad = tmp_path / "bad"
    out = _cli(
        tmp_path,
        "prove-resume",
        *_config_args(COUNTER, tmp_path),
        "--run-dir",
        str(bad),
        "--reference",
        str(proof / "proof" / "reference"),
        "--skip-restore",
        "rng",
        "--no-track",
    )
    assert out.returncode != 0
    v = json.loads((bad / "proof" / "verdict.json").read_text())
    assert not v["final_state_identical"] and "rng" in v["first_differing_leaf"]


@pytest.mark.parametrize(
    "sets, why",
    [
        (["objective.kind=open_objectives:Nope"], "Nope in open_objectives is not an Objective"),
        (["objective.kind=no_such_module:X"], "cannot import no_such_module"),
        (["model.hidden=0"], "model.hidden=0 must be in"),
        (["objective.digits.train_images=5"], "objective.digits.train_images=5"),
        (["objective.dpo.beta=0.2"], "applies to objective.kind=dpo"),
        (["objective.init=/tmp/x"], "applies to objective.kind="),
        (["model.family=no_such_family"], "model.family='no_such_family' is not registered"),
        (["model.d_model=64"], "unknown config key 'model.d_model'"),
    ],
)
def test_bad_open_objective_settings_are_one_line_and_write_nothing(tmp_path, sets, why):
    run = tmp_path / "run"
    out = _cli(tmp_path, "train", *_config_args(DIGITS, tmp_path, *sets), "--run-dir", str(run))
    assert out.returncode != 0 and why in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not run.exists()
