"""`tpulab hypothesis`: baseline vs changed config side by side, a verdict either way."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, run_cli, run_main, tiny_config


def test_verdict_and_prediction_parsing():
    from tpulab.errors import TpulabError
    from tpulab.perf.hypothesis import predicted_change, verdict

    assert predicted_change("copies are 15% of the step; removing them: step time -15%") == -15.0
    assert verdict(-15.0, -12.0)["verdict"] == "confirmed"
    assert verdict(-15.0, +3.0)["verdict"] == "refuted"  # wrong sign
    assert verdict(-40.0, -5.0)["verdict"] == "refuted"  # right sign, far off
    with pytest.raises(TpulabError, match="signed percentage"):
        predicted_change("it will be faster")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("step time -15%", -15.0),
        ("step time +15%", 15.0),
        ("step time \u22122.5 %", -2.5),  # U+2212 MINUS SIGN
        ("the profile puts 21% of the step in RNG; step time -21%", -21.0),
    ],
)
def test_prediction_reads_the_signed_last_percentage(text, expected):
    from tpulab.perf.hypothesis import predicted_change

    assert predicted_change(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "step time 15%",  # was a ValueError traceback: the class [+-\u2212] matched the "e"
        "3 15%",  # was read as +315%: the same class matched the digit 3
        "12-15%",  # a range, not a signed -15%
        "step time -15%, so about 15%",  # the last percentage decides, and it has no sign
    ],
)
def test_prediction_without_a_sign_is_refused_in_one_line(text):
    from tpulab.errors import TpulabError
    from tpulab.perf.hypothesis import predicted_change

    with pytest.raises(TpulabError, match="has no sign") as e:
        predicted_change(text)
    assert "\n" not in str(e.value)


def test_hypothesis_runner_alternates_same_batches_and_keeps_quality_evidence(tmp_path):
    from tpulab.perf.hypothesis import run_hypothesis

    # A deliberately wrong prediction (dropout off makes the step 50% slower): must be refuted.
    r = run_hypothesis(
        tiny_config(), "model.dropout=0", "step time +50%", tmp_path, steps=23, skip=3
    )
    assert r["verdict"] == "refuted" and r["predicted_step_time_change_pct"] == 50.0
    assert len(r["baseline"]["times"]) == len(r["changed"]["times"]) == 23
    assert r["baseline"]["losses"][0] == pytest.approx(
        r["changed"]["losses"][0], rel=0.05
    )  # same init, same batch
    assert r["baseline"]["losses"] != r["changed"]["losses"]  # the change did change the run
    assert r["quality_within_tolerance"] == (r["val_loss_difference"] <= r["loss_tolerance"])
    assert (tmp_path / "hypothesis.png").stat().st_size > 0
    assert json.loads((tmp_path / "hypothesis.json").read_text())["environment"]["backend"] == "cpu"


def test_hypothesis_bad_input_is_one_line(tmp_path, capfd):
    # One real process (the exit status and stderr as a shell sees them); the other refusals go
    # through the same `main` in-process (a child only adds its 3.2 CPU-s of imports).
    for extra, expect, in_process in (
        (["--change", "model.dropout=0.1", "--predict=step time -10%"], "leaves the config", False),
        (["--change", "model.dropout=0", "--predict=faster"], "signed percentage", True),
        (["--change", "model.dropout=0", "--predict=step time 15%"], "has no sign", True),
        (["--change", "model.nope=1", "--predict=step time -10%"], "unknown config key", True),
    ):
        argv = ["hypothesis", "--run-dir", str(tmp_path / "run"), "--config", str(TINY), *extra]
        r = run_main(capfd, *argv) if in_process else run_cli(*argv)
        rc, err = r.returncode, r.stderr
        assert rc == 2 and err.startswith("error: ") and expect in err, err
        assert "Traceback" not in err and not (tmp_path / "run").exists()
