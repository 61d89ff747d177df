"""Bad input: one line on stderr naming the problem, a non-zero exit, no traceback, nothing deleted."""

import shutil

import pytest

from conftest import TINY, run_cli


def assert_one_line_error(result, *needles):
    err = result.stderr.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1, result.stderr
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize("override, needle", [
    ("model.bogus=1", "unknown config key 'model.bogus'"),
    ("optim.lr=-0.1", "optim.lr=-0.1 must be positive"),
    ("data.seq_len=999", "data.seq_len=999 exceeds model.max_seq_len=32"),
    ("model.n_heads=5", "model.d_model=32 is not divisible by model.n_heads=5"),
])
def test_bad_config_values(tmp_path, override, needle):
    result = run_cli("train", "--run-dir", str(tmp_path / "r"), "--config", str(TINY), "--set", override)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "r").exists()


def test_bad_paths(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_one_line_error(run_cli("train", "--run-dir", str(a_file), "--config", str(TINY)), "is not a directory")
    assert a_file.read_text() == "x"
    assert_one_line_error(run_cli("train", "--run-dir", "/proc/tpulab-run", "--config", str(TINY)),
                          "cannot create run dir")
    assert_one_line_error(run_cli("train", "--run-dir", str(tmp_path / "r"), "--config", str(TINY),
                                  "--data", str(tmp_path / "nope")), "corpus not found")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("train", "--run-dir", str(tmp_path / "r"), "--config", str(TINY),
                                  "--data", str(tmp_path / "empty")), "holds no *.txt files")
    assert_one_line_error(run_cli("train", "--run-dir", str(tmp_path / "r"), "--config", str(tmp_path / "no.yaml")),
                          "config file not found")


def test_corrupt_checkpoints_refused_and_kept(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for step in ("20", "30", "40"):
        manifest = run / "checkpoints" / step / "tpulab_manifest.json"
        manifest.write_text(manifest.read_text().replace('"sha256": "', '"sha256": "0', 1))
    result = run_cli("train", "--run-dir", str(run), "--config", str(TINY), "--steps", "45")
    assert_one_line_error(result, "no checkpoint", "passes verification")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "30", "40"]
    assert_one_line_error(run_cli("check", "--run-dir", str(run)), "no valid checkpoint")


def test_changed_config_on_resume(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    result = run_cli("train", "--run-dir", str(run), "--config", str(TINY), "--set", "model.dropout=0.2")
    assert_one_line_error(result, "refusing to resume step 40", "model.dropout", "--force")
