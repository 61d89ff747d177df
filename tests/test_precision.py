"""`tpulab precision`: every policy measured against fp32 on held-out text of a trained run."""

from __future__ import annotations

from conftest import run_cli


def test_precision_table_measures_each_policy_against_fp32(trained_run, tmp_path):
    from tpulab.perf.precision import ROWS, write_precision

    r = write_precision(trained_run, tmp_path / "precision", windows=2, train_steps=20)
    rows = {row["policy"]: row for row in r["rows"]}
    assert list(rows) == list(ROWS)
    fp32 = rows["fp32"]
    # Against the independent float64 reference the fp32 row has its own, real rounding error
    # (6e-7 here), not the zero of a forward compared with itself ...
    assert 0 < fp32["max_abs_logit_diff"] < 1e-4 and fp32["greedy_agreement"] == 1.0
    assert "float64" in r["reference"]
    # ... and every lower precision shows a larger, still small, difference.
    for name in ("bf16-compute", "bf16-params", "int8-weights", "int8-cache"):
        assert fp32["max_abs_logit_diff"] < rows[name]["max_abs_logit_diff"] < 1.0, name
        assert rows[name]["mean_kl"] > fp32["mean_kl"], name
        assert abs(rows[name]["heldout_loss"] - fp32["heldout_loss"]) < 0.05, name
    assert rows["bf16-params"]["weight_bytes"] == fp32["weight_bytes"] // 2
    assert rows["int8-weights"]["weight_bytes"] < fp32["weight_bytes"] / 3
    assert rows["int8-cache"]["kv_bytes_per_token"] < rows["fp32"]["kv_bytes_per_token"] / 2
    assert all(rows[n]["train_step_ms"] > 0 for n in ("fp32", "bf16-compute", "bf16-params"))
    assert "train_step_ms" not in rows["int8-weights"]
    assert (
        r["environment"]["backend"] == "cpu" and (tmp_path / "precision" / "precision.md").exists()
    )


def test_emulated_bf16_train_steps_can_be_left_untimed_on_a_cpu(trained_run, tmp_path):
    """The dossier's demo plan: every row's accuracy, the fp32 train step timed, the bf16 training
    rows still training rows (the precision decision reads them) with no time; the default above
    (the control) times all three."""
    from tpulab.orchestrate.dossier import recommend_precision
    from tpulab.perf.precision import markdown, write_precision

    r = write_precision(trained_run, tmp_path / "p", windows=2, time_emulated=False)
    rows = {row["policy"]: row for row in r["rows"]}
    assert rows["fp32"]["train_step_ms"] > 0
    assert rows["bf16-compute"]["train_step_ms"] is None is rows["bf16-params"]["train_step_ms"]
    assert rows["bf16-compute"]["mean_kl"] > rows["fp32"]["mean_kl"]  # measured all the same
    assert markdown(r).count("not timed (bf16 emulated)") == 2
    assert recommend_precision(r["rows"], 32)["train"] in ("bf16-compute", "fp32")
    assert "bf16-compute" in recommend_precision(r["rows"], 32)["accepted"]


def test_precision_without_a_checkpoint_is_one_line(tmp_path):
    r = run_cli("precision", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "precision").exists()


def test_a_reference_that_computes_another_function_fails_the_fp32_check(trained_run):
    """Negative control: the check compares two real computations. The same reference with another
    RoPE base (500 instead of 10000) disagrees with the model's fp32 forward beyond fp32 rounding,
    and the fp32 check refuses it in one line."""
    import dataclasses

    import jax
    import numpy as np
    import pytest

    from tpulab.data.tokenizer import PAD
    from tpulab.errors import TpulabError
    from tpulab.inference.cache_eval import heldout_windows
    from tpulab.model.decode import ModelFns
    from tpulab.perf.precision import check_fp32, compare, reference_logits
    from tpulab.train.restore import load_model

    src = load_model(trained_run)
    win = heldout_windows(src.config, 2)
    inputs, targets = win[:, :-1], win[:, 1:]
    fns = ModelFns(src.model)
    fp32 = np.asarray(jax.jit(fns.full_logits)(fns.params, inputs))
    right = compare(
        reference_logits(fns.params, src.config.model, inputs), fp32, targets, targets != PAD
    )
    check_fp32(right)  # passes: the two agree to fp32 rounding
    other = dataclasses.replace(src.config.model, rope_base=500.0)
    wrong = compare(reference_logits(fns.params, other, inputs), fp32, targets, targets != PAD)
    assert wrong["max_abs_logit_diff"] > 10 * right["max_abs_logit_diff"]
    with pytest.raises(TpulabError, match="independent float64 reference") as e:
        check_fp32(wrong)
    assert "\n" not in str(e.value)
