"""The runner the capstone and the dossier share (tpulab.orchestrate.stages), and the capstone's
MLflow store reaching its children in their own environment, never through this process's."""

from __future__ import annotations

import os

import pytest

from conftest import tiny_config
from tpulab.errors import ExitCode, TpulabError
from tpulab.orchestrate.stages import Stages, prepare_out


def test_a_failed_stage_is_reported_written_and_exits_failed(tmp_path):
    stages = Stages("t")
    stages.run("good", lambda: "## good\n\nfine")

    def bad() -> str:
        raise TpulabError("no disk")

    stages.run("bad", bad)
    assert stages.status() == "Status: **FAIL** — bad: no disk"
    assert stages.body() == "## good\n\nfine\n\n## bad\n\n**FAILED**: no disk"
    assert stages.times().startswith("Stage times: good 0 s, bad 0 s")
    path = tmp_path / "report.md"

    def write():
        path.write_text(stages.body())
        return path

    with pytest.raises(TpulabError, match=r"^run failed \(bad: no disk\); see .*report.md") as e:
        stages.finish(write, "run failed")
    assert e.value.exit_code == ExitCode.FAILED and "**FAILED**: no disk" in path.read_text()
    # control: with no failure the same runner passes and returns the path
    ok = Stages("t")
    ok.run("good", lambda: "## good")
    assert ok.status() == "Status: **PASS**" and ok.finish(lambda: path, "x") == path


def test_prepare_out_refuses_a_used_dir(tmp_path):
    assert prepare_out(tmp_path / "new").is_dir()
    (tmp_path / "new" / "keep").write_text("evidence")
    with pytest.raises(TpulabError, match="already exists and is not empty"):
        prepare_out(tmp_path / "new")
    assert (tmp_path / "new" / "keep").read_text() == "evidence"


def test_capstone_gives_its_store_to_children_and_leaves_os_environ_alone(tmp_path, monkeypatch):
    """The training child (stopped at once here, so the rest is skipped) gets the capstone's
    store in the environment it is given; this process's environment is never changed, not
    even while the child runs (the old capstone set and later popped MLFLOW_TRACKING_URI)."""
    from tpulab.orchestrate import capstone
    from tpulab.tracking.store import STORE_NAME, sqlite_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = dict(os.environ)
    seen = []

    def child(argv, log_path, env, timeout_s, what):
        seen.append((what, env.get("MLFLOW_TRACKING_URI"), dict(os.environ)))
        raise TpulabError(f"{what}: stopped by the test")

    monkeypatch.setattr(capstone, "run_to_completion", child)
    out = tmp_path / "cap"
    skip = capstone.CapstoneOptions(
        skip_bridge=True,
        skip_inference=True,
        chaos_kills=0,
        skip_scaleout=True,
        skip_dossier=True,
        skip_posttrain=True,
    )
    with pytest.raises(TpulabError, match="capstone failed") as e:
        capstone.run_capstone(tiny_config(), out, skip)
    assert e.value.exit_code == ExitCode.FAILED
    assert [(w, uri) for w, uri, _ in seen] == [
        ("training run", sqlite_uri(out.absolute() / STORE_NAME))
    ]
    assert seen[0][2] == before, "os.environ changed while the child ran"
    assert dict(os.environ) == before
    report = (out / "report.md").read_text()  # written although a stage failed
    assert "Status: **FAIL**" in report and "training run: stopped by the test" in report
