"""`tpulab precision`: every policy measured against fp32 on held-out text of a trained run."""

from __future__ import annotations

from conftest import run_cli


def test_precision_table_measures_each_policy_against_fp32(trained_run, tmp_path):
    from tpulab.perf.precision import ROWS, write_precision

    r = write_precision(trained_run, tmp_path / "precision", windows=2, train_steps=20)
    rows = {row["policy"]: row for row in r["rows"]}
    assert list(rows) == list(ROWS)
    fp32 = rows["fp32"]
    # The reference against itself is exactly zero: the metrics compare, they do not invent error ...
    assert (
        fp32["max_abs_logit_diff"] == 0.0
        and fp32["mean_kl"] == 0.0
        and fp32["greedy_agreement"] == 1.0
    )
    # ... and every lower precision shows a (small) non-zero difference.
    for name in ("bf16-compute", "bf16-params", "int8-weights", "int8-cache"):
        assert 0 < rows[name]["max_abs_logit_diff"] < 1.0, name
        assert abs(rows[name]["heldout_loss"] - fp32["heldout_loss"]) < 0.05, name
    assert rows["bf16-params"]["weight_bytes"] == fp32["weight_bytes"] // 2
    assert rows["int8-weights"]["weight_bytes"] < fp32["weight_bytes"] / 3
    assert rows["int8-cache"]["kv_bytes_per_token"] < rows["fp32"]["kv_bytes_per_token"] / 2
    assert all(rows[n]["train_step_ms"] > 0 for n in ("fp32", "bf16-compute", "bf16-params"))
    assert "train_step_ms" not in rows["int8-weights"]
    assert (
        r["environment"]["backend"] == "cpu" and (tmp_path / "precision" / "precision.md").exists()
    )


def test_precision_without_a_checkpoint_is_one_line(tmp_path):
    r = run_cli("precision", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "precision").exists()
