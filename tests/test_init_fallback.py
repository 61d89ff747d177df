"""objective.init_fallback: a base whose newest checkpoint fails verification is read at its
newest verified step with one warning line, recorded in env.json and MLflow, or refused in one line
with nothing written; children of proofs and chains refuse unless their config says warn."""

from __future__ import annotations

import shutil

import pytest

from conftest import TINY, run_main, tiny_config
from tpulab.checkpoint.files import MANIFEST
from tpulab.checkpoint.rundir import RunDir
from tpulab.errors import ConfigError
from tpulab.proofs.transformer import child_config, write_child_config
from tpulab.tracking.lineage import lineage_tags
from tpulab.train.restore import check_older_steps, load_model

SFT = ("objective.kind=sft", "train.steps=2", "train.eval_every=2", "checkpoint.save_every=2")


@pytest.fixture
def corrupt_base(trained_run, tmp_path):
    """A copy of ``trained_run`` (steps 20, 30, 40) whose newest step's manifest is corrupt."""
    base = tmp_path / "base"
    shutil.copytree(trained_run, base)
    (base / "checkpoints" / "40" / MANIFEST).write_text("{}")
    return base


def train_sft(capfd, base, run, uri, *extra):
    sets = [a for s in (*SFT, f"objective.init={base}", *extra) for a in ("--set", s)]
    argv = ["train", "--config", TINY, "--run-dir", run, "--no-progress", "--tracking-uri", uri]
    return run_main(capfd, *argv, *sets)


def test_a_corrupt_newest_base_step_is_warned_and_recorded_in_the_run_and_mlflow(
    corrupt_base, tmp_path, capfd
):
    run, uri = tmp_path / "sft", f"sqlite:///{tmp_path / 'mlruns.db'}"
    done = train_sft(capfd, corrupt_base, run, uri)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith(f"warning: init run {corrupt_base}: step 40 skipped (corrupt: ")
    assert warnings[0].endswith("; using step 30")
    env = RunDir(run).read_env()
    (record,) = env.details["init_fallback"]
    assert record["step"] == 30 and [s["step"] for s in record["skipped"]] == [40]
    assert env.identities["base"] == load_model(corrupt_base, 30).checkpoint_digest
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs(client.search_experiments()[0].experiment_id)
    assert mlrun.data.tags["tpulab.init_fallback"] == warnings[0].removeprefix("warning: ")


def test_refuse_is_one_line_and_writes_nothing(corrupt_base, tmp_path, capfd):
    run, uri = tmp_path / "sft", f"sqlite:///{tmp_path / 'mlruns.db'}"
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    done = train_sft(capfd, corrupt_base, run, uri, "objective.init_fallback=refuse")
    assert done.returncode == 2  # bad input: the base named is not the one it would read
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: init run ")
    assert (
        "step 40 skipped (corrupt: " in done.stderr and "refusing its older step 30" in done.stderr
    )
    after = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert after == before and not run.exists()


def test_an_intact_base_gives_no_warning_and_no_record(trained_run, sft_policy, capfd):
    capfd.readouterr()
    cfg = tiny_config(*SFT, f"objective.init={trained_run}", "objective.init_fallback=refuse")
    assert check_older_steps(cfg) == []
    assert capfd.readouterr().err == ""
    env = RunDir(sft_policy).read_env()  # an SFT run trained from the intact base
    assert "init_fallback" not in env.details
    assert "tpulab.init_fallback" not in lineage_tags(sft_policy, env.to_dict())


def test_the_older_steps_check_warns_once_per_run_named(corrupt_base, capfd):
    capfd.readouterr()
    cfg = tiny_config(
        "objective.kind=dpo",
        f"objective.init={corrupt_base}",
        f"objective.reference={corrupt_base}",
    )
    (record,) = check_older_steps(cfg)  # init and reference name one run: said once
    assert record["key"] == "init" and capfd.readouterr().err.count("warning:") == 1


def test_children_refuse_unless_their_config_says_warn(trained_run, tmp_path):
    sft = tiny_config(*SFT, f"objective.init={trained_run}")
    assert sft.objective.init_fallback is None
    written = write_child_config(sft, tmp_path / "child.yaml")
    assert "init_fallback: refuse" in written.read_text()
    warn = tiny_config(*SFT, f"objective.init={trained_run}", "objective.init_fallback=warn")
    assert child_config(warn).objective.init_fallback == "warn"
    assert child_config(tiny_config()) == tiny_config()  # pretraining reads no base


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (("objective.init_fallback=maybe",), "must be one of \\['warn', 'refuse'\\]"),
        (("objective.kind=pretrain", "objective.init_fallback=warn"), "pretraining has none"),
    ],
)
def test_a_bad_init_fallback_is_one_line(sets, match, trained_run):
    base = () if "objective.kind=pretrain" in sets else (*SFT, f"objective.init={trained_run}")
    with pytest.raises(ConfigError, match=match):
        tiny_config(*base, *sets)
