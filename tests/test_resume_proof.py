"""The kill/resume proof end to end, with real processes and SIGKILL, and the controls that show
it can fail."""

import json
import os
import shutil
import signal
import sys
import time

import pytest

from conftest import REPO, TINY, run_main, tiny_config
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import curve, read_records
from tpulab.proofs.driver import Proc, prove_resume
from tpulab.proofs.transformer import check_reference, prove_transformer_resume

pytestmark = pytest.mark.slow
VERDICT_KEYS = {
    "identical",
    "max_abs_diff",
    "steps_compared",
    "kill_step",
    "resumed_from_step",
    "signal",
}


def test_prove_resume_is_bitwise_identical(tiny_proof):
    """`tpulab prove-resume --config configs/tiny.yaml` (conftest.tiny_proof: exit 0 checked
    there), its verdict and overlay."""
    tmp_path = tiny_proof
    verdict = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert VERDICT_KEYS <= set(verdict)
    assert (
        verdict["identical"] is True
        and verdict["max_abs_diff"] == 0.0
        and verdict["signal"] == "SIGKILL"
    )
    assert verdict["curves_identical"] is True and verdict["final_state_identical"] is True
    assert verdict["first_differing_leaf"] is None and verdict["leaves_compared"] > 20
    assert verdict["steps_compared"] == 40 and verdict["kill_step"] == 24
    assert (
        verdict["resumed_from_step"] in (10, 20) and verdict["steps_redone"] > 0
    )  # killed between checkpoints
    assert (tmp_path / "proof" / "overlay.png").stat().st_size > 10_000
    # the resumed process compiled from a fresh, empty cache (JAX's own events), as on a new machine
    caches = verdict["compile_cache"]
    resumed = caches["processes"]["resumed"]
    assert caches["resumed_cache"].startswith("cold") and resumed["cold"] is True
    assert resumed["hits"] == 0 and resumed["misses"] > 0 and resumed["cold_confirmed"] is True
    assert resumed["entries_at_first_lookup"] == 0
    assert resumed["entries_after"] == resumed["misses"]
    assert caches["processes"]["killed"]["requests"] > 0
    assert resumed["cache_dir"] != caches["processes"]["killed"]["cache_dir"]
    # --no-track reached both children (tracked by default: the capstone's tracking section fails
    # on a proof run dir without this file, tests/test_capstone.py)
    assert not (tmp_path / "proof" / "interrupted" / "mlflow_run.json").exists()


@pytest.mark.parametrize("part", ["rng", "data"])
def test_negative_control_resume_without_part_is_caught(trained_run, tmp_path, part):
    """Resuming without the dropout key or the data position must be reported as NOT identical.
    The reference is ``trained_run`` (the same tiny config, finished, uninterrupted), reused. The
    driver runs in this process (its killed and resumed trainers are real children); the CLI's
    exit code for a NOT identical verdict is asserted by the whole-state control below."""
    prove_transformer_resume(
        tiny_config(),
        tmp_path,
        reference_dir=trained_run,
        skip_restore=(part,),
        warm_resume_cache=True,  # the judge is under test here; the cold resume is proven above
        track=False,
    )
    verdict = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert verdict["reference_dir"] == str(trained_run)
    assert not (tmp_path / "proof" / "reference").exists()
    assert verdict["identical"] is False and verdict["max_abs_diff"] > 0
    assert verdict["first_differing_step"] == verdict["resumed_from_step"] + 1


def test_whole_state_verdict_catches_what_the_curves_cannot(tmp_path, capfd):
    """Negative control for the whole-state verdict: with dropout off, a resume that drops the
    dropout key logs exactly the reference losses (the key is never used), so the curves match; only
    the final-state comparison sees the different key, and the verdict must say NOT identical,
    naming the rng leaf. The only proof here that trains its own reference (no ``--reference``).
    The CLI runs in this process (``run_main``: its exit code is main's; its three trainers are
    real children)."""
    result = run_main(
        capfd,
        "prove-resume",
        "--run-dir",
        tmp_path,
        "--config",
        TINY,
        "--set",
        "model.dropout=0.0",
        "--skip-restore",
        "rng",
        "--warm-resume-cache",
        "--no-track",  # MLflow lineage of proofs: tests/test_capstone.py
    )
    assert result.returncode == ExitCode.FAILED, result.stderr
    verdict = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert verdict["curves_identical"] is True and verdict["max_abs_diff"] == 0.0
    # the warm path (control of the cold one): the resumed process loaded the killed run's programs
    resumed = verdict["compile_cache"]["processes"]["resumed"]
    assert resumed["hits"] > 0 and resumed["cold"] is False and "cold_confirmed" not in resumed
    assert resumed["entries_at_first_lookup"] > 0
    assert verdict["final_state_identical"] is False and verdict["identical"] is False
    assert "rng" in verdict["first_differing_leaf"]


def test_only_a_finished_uninterrupted_run_of_the_same_config_is_a_reference(
    trained_run, tmp_path, capfd
):
    """``--reference`` refusals: one line, exit 2, nothing written; the accepted case is the
    negative controls above."""
    assert check_reference(trained_run, tiny_config()) == trained_run
    with pytest.raises(TpulabError, match="another config"):
        check_reference(trained_run, tiny_config("optim.lr=0.002"))
    with pytest.raises(TpulabError, match="holds no run"):
        check_reference(tmp_path, tiny_config())
    short = tmp_path / "short"
    shutil.copytree(trained_run, short)
    lines = (short / "metrics.jsonl").read_text().splitlines()
    (short / "metrics.jsonl").write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    with pytest.raises(TpulabError, match="did not finish"):
        check_reference(short, tiny_config())
    resumed = tmp_path / "resumed"
    shutil.copytree(trained_run, resumed)
    first = (resumed / "metrics.jsonl").read_text().splitlines()[0]
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write(first.replace('"segment": 0', '"segment": 1') + "\n")
    with pytest.raises(TpulabError, match="was resumed"):
        check_reference(resumed, tiny_config())
    out = tmp_path / "proof-run"
    # the CLI in this process (run_main): a refusal before any child starts
    result = run_main(
        capfd, "prove-resume", "--run-dir", out, "--config", TINY, "--reference", short
    )
    assert result.returncode == ExitCode.BAD_INPUT and len(result.stderr.strip().splitlines()) == 1
    assert "did not finish" in result.stderr and not out.exists()
    # --no-track is for the one-process proof's children: refused with --processes, in one line
    argv = ["prove-resume", "--run-dir", out, "--config", TINY, "--processes", "2"]
    result = run_main(capfd, *argv, "--no-track")
    assert result.returncode == ExitCode.BAD_INPUT and not out.exists()
    assert result.stderr == "error: --no-track is for a one-process proof; drop it or --processes\n"


def test_kill_during_an_unfinished_save_never_uses_the_half_written_checkpoint(
    trained_run, tmp_path
):
    """Step 30's save is issued but its completion marker is never written (as if the process died
    while the async save was in flight); the kill lands after step 31. Depending on timing, Orbax's
    own write of step 30 is still in its temporary dir or finished but unmarked; either way the
    resume must not use it, must keep an unmarked one aside, and must match the reference
    bitwise."""
    from tpulab.proofs.state import final_state_verdict

    def hooked(d):
        return [
            sys.executable,
            str(REPO / "tests" / "hooked_train.py"),
            *("--config", str(TINY), "--run-dir", str(d), "--withhold-commit", "30"),
        ]

    verdict = prove_resume(
        hooked,
        tmp_path / "proof",
        steps=40,
        kill_at=31,
        reference_dir=check_reference(trained_run, tiny_config()),  # the same run, reused
        compare_state=final_state_verdict,
    )
    assert verdict["identical"] is True
    assert verdict["resumed_from_step"] == 20 and verdict["kill_step"] == 31
    at_kill = verdict["checkpoints_at_kill"]
    assert "20" in at_kill and any(
        name == "30" or name.startswith("30.orbax-checkpoint-tmp") for name in at_kill
    )
    if "30" in at_kill:  # Orbax finished, the marker did not: refused and kept aside
        rejected = list((tmp_path / "proof" / "interrupted" / "rejected_checkpoints").iterdir())
        assert [p.name.split("-")[0] for p in rejected] == ["30"]
        assert "refusing checkpoint step 30" in (tmp_path / "proof" / "resumed.log").read_text()


def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path):
    """A real SIGTERM to a `tpulab train` process: it saves, exits 0, and the run resumes from
    that save (the resume runs in this process: the signal is what crosses the boundary)."""
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "tpulab.cli",
        "train",
        "--run-dir",
        str(run),
        "--config",
        str(TINY),
        "--steps",
        "5000",
        "--no-progress",
        "--no-track",
    ]
    with Proc(argv, tmp_path / "log.txt", dict(os.environ)) as proc:
        deadline = time.monotonic() + 120
        while max(curve(read_records(run)) or [0]) < 15:
            assert proc.p.poll() is None and time.monotonic() < deadline, proc.tail()
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.p.pid, signal.SIGTERM)
        rc = proc.p.wait(timeout=60)
        took = time.monotonic() - t0
    assert rc == ExitCode.OK, (tmp_path / "log.txt").read_text()
    assert took < 30
    from tpulab.checkpoint.rundir import RunDir

    summary = RunDir(run).read_summary()
    last = max(curve(read_records(run)))
    assert summary.preempted and summary.latest_checkpoint == last == summary.final_step
    from tpulab.train.loop import train

    resumed = train(tiny_config(f"train.steps={last + 3}"), run, progress=False)
    assert resumed.resumed_from == last and resumed.final_step == last + 3
    starts = [r for r in read_records(run) if r.get("event") == "start"]
    assert starts[-1]["resumed_from"] == last
