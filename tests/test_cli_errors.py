"""Bad input: one line on stderr naming the problem, a non-zero exit, no traceback, nothing lost.

The CLI runs in this process (``conftest.run_main``: ``tpulab.cli.main.main``, its exit code and
its output), since argument validation crosses no process boundary; one real ``python -m
tpulab.cli`` process (``test_config_errors_come_before_jax_is_imported``) shows the same refusal at
the process level: exit status, stderr, nothing written, and no JAX import on the way.
"""

import shutil

import pytest

from conftest import TINY, run_cli, run_main


def assert_one_line_error(result, *needles):
    err = result.stderr.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1, result.stderr
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.bogus=1", "unknown config key 'model.bogus'"),
        ("optim.lr=-0.1", "optim.lr=-0.1 must be positive"),
        ("data.seq_len=999", "data.seq_len=999 exceeds model.max_seq_len=32"),
        ("model.n_heads=5", "model.d_model=32 is not divisible by model.n_heads=5"),
    ],
)
def test_bad_config_values(tmp_path, capfd, override, needle):
    result = run_main(
        capfd, "train", "--run-dir", tmp_path / "r", "--config", TINY, "--set", override
    )
    assert_one_line_error(result, needle)
    assert not (tmp_path / "r").exists()


BINARY_JUNK = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x80\x81"
LATIN1_YAML = "seed: 0\n# Fran\xe7ois\n".encode("latin-1")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--set", "optim.lr=inf"], "config key 'optim.lr' must be a finite number, got 'inf'"),
        (["--set", "optim.eps=.inf"], "config key 'optim.eps' must be a finite number, got inf"),
        (["--set", "optim.b2=nan"], "config key 'optim.b2' must be a finite number"),
        (["--set", f"seed={10**25}"], "seed=10000000000000000000000000 must be in [0, 4294967295]"),
        (["--set", f"model.d_model={10**12}"], "model.d_model=1000000000000 must be in [1, 65536]"),
        (["--data", "x" * 5000], "data.path is 5000 bytes long"),
        (["--data", ""], "data.path must not be empty"),
        (["--config", "junk.yaml"], "junk.yaml is not UTF-8 text (byte 0xff at offset 0)"),
        (["--config", "latin1.yaml"], "latin1.yaml is not UTF-8 text (byte 0xe7 at offset 14)"),
        (["--run-dir", ""], "--run-dir must not be empty"),
    ],
    ids=[
        "lr-inf",
        "eps-inf",
        "b2-nan",
        "huge-seed",
        "huge-d_model",
        "long-data-path",
        "empty-data-path",
        "binary-config",
        "latin1-config",
        "empty-run-dir",
    ],
)
def test_bad_input_found_by_attack(tmp_path, capfd, monkeypatch, extra, needle):
    """Each fails before training: one line, and nothing written anywhere (the cwd included). A
    model too big for memory is refused the same way by the real process below."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "junk.yaml").write_bytes(BINARY_JUNK)
    (tmp_path / "latin1.yaml").write_bytes(LATIN1_YAML)
    extra = [str(tmp_path / a) if a in ("junk.yaml", "latin1.yaml") else a for a in extra]
    args = ["--run-dir", str(tmp_path / "r"), "--config", str(TINY), *extra]  # later flags win
    result = run_main(capfd, "train", *args)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "r").exists() and list(cwd.iterdir()) == []


def test_config_errors_come_before_jax_is_imported(tmp_path):
    """Fast failure: the config is validated (memory estimate included) before the heavy imports;
    a real process, its exit status, one error line, nothing written (the cwd included)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_cli(
        "train",
        "--run-dir",
        str(tmp_path / "r"),
        "--config",
        str(TINY),
        "--set",
        "model.d_model=65536",
        "--set",
        "model.n_layers=4096",
        env={"PYTHONPROFILEIMPORTTIME": "1"},
        timeout=60,
        cwd=cwd,
    )
    imported = {
        line.split("|")[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert (
        "tpulab.config" in imported and "tpulab.train.memory" in imported
    )  # the profile sees our imports
    assert not {
        m for m in imported if m == "jax" or m.startswith(("jax.", "jaxlib", "flax", "optax"))
    }
    assert_one_line_error(result, "the model cannot fit in memory")
    assert not (tmp_path / "r").exists() and list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--run-dir", ""],
        ["prove-resume", "--run-dir", ""],
        ["capstone", "--out", ""],
        ["check", "--config", ""],
    ],
)
def test_empty_paths_never_mean_the_current_directory(tmp_path, capfd, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    result = run_main(capfd, *argv)
    assert_one_line_error(result, f"{argv[1]} must not be empty")
    assert list(tmp_path.iterdir()) == []


def test_bad_paths(tmp_path, capfd):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_one_line_error(
        run_main(capfd, "train", "--run-dir", str(a_file), "--config", str(TINY)),
        "is not a directory",
    )
    assert a_file.read_text() == "x"
    assert_one_line_error(
        run_main(capfd, "train", "--run-dir", "/proc/tpulab-run", "--config", str(TINY)),
        "cannot create run dir",
    )
    assert_one_line_error(
        run_main(
            capfd,
            "train",
            "--run-dir",
            str(tmp_path / "r"),
            "--config",
            str(TINY),
            "--data",
            str(tmp_path / "nope"),
        ),
        "corpus not found",
    )
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        run_main(
            capfd,
            "train",
            "--run-dir",
            str(tmp_path / "r"),
            "--config",
            str(TINY),
            "--data",
            str(tmp_path / "empty"),
        ),
        "holds no *.txt files",
    )
    assert_one_line_error(
        run_main(
            capfd, "train", "--run-dir", str(tmp_path / "r"), "--config", str(tmp_path / "no.yaml")
        ),
        "config file not found",
    )


def test_corrupt_checkpoints_refused_and_kept(trained_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for step in ("20", "30", "40"):
        manifest = run / "checkpoints" / step / "tpulab_manifest.json"
        manifest.write_text(manifest.read_text().replace('"sha256": "', '"sha256": "0', 1))
    result = run_main(capfd, "train", "--run-dir", str(run), "--config", str(TINY), "--steps", "45")
    assert_one_line_error(result, "no checkpoint", "passes verification")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        "20",
        "30",
        "40",
    ]
    assert_one_line_error(run_main(capfd, "check", "--run-dir", str(run)), "no valid checkpoint")


def test_changed_config_on_resume(trained_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    result = run_main(
        capfd, "train", "--run-dir", str(run), "--config", str(TINY), "--set", "model.dropout=0.2"
    )
    assert_one_line_error(result, "refusing to resume step 40", "model.dropout", "--force")
