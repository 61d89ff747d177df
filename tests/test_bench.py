"""`tpulab bench`: synchronized steady state, zero recompiles (with a control that forces one), FLOP accounting."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, tiny_config


def test_bench_counts_no_recompiles_and_catches_a_forced_one():
    from tpulab.perf.bench import RecompileError, bench_step, check_no_recompiles, synthetic_batch

    cfg = tiny_config("model.dropout=0")
    r = bench_step(cfg, steps=20, warmup=2)
    assert r["recompiles_after_warmup"] == 0 and r["host_syncs_per_step"] == 1
    assert (
        r["step_time"]["steps"] == 20
        and r["step_time"]["p10_s"] <= r["step_time"]["median_s"] <= r["step_time"]["p90_s"]
    )
    assert r["compile_s"] > 0 and r["tokens_per_s"] > 0
    assert r["flops_per_step_compiler"] > 0.8 * r["flops_per_step_analytic"]
    # every timed GEMM shape together is exactly the analytic count: the utilization has one denominator
    assert r["matmul"]["gemm_flops_per_step"] == pytest.approx(r["flops_per_step_analytic"])
    assert 0 < r["utilization_vs_matmul_rate"]
    check_no_recompiles(r)

    # Negative control: a batch with fewer rows from step 5 on (as a ragged last batch would) recompiles.
    short = synthetic_batch(tiny_config("model.dropout=0", "data.batch_size=4"))
    forced = bench_step(
        cfg,
        steps=20,
        warmup=2,
        measure_matmul=False,
        batch_fn=lambda i: short if i >= 5 else synthetic_batch(cfg),
    )
    assert forced["recompiles_after_warmup"] == 1
    with pytest.raises(RecompileError, match="compiled 1 more time"):
        check_no_recompiles(forced)


def test_bench_refuses_too_few_steps_and_bad_sweeps(tmp_path):
    from tpulab.errors import TpulabError
    from tpulab.perf.bench import bench_step

    with pytest.raises(TpulabError, match="at least 20"):
        bench_step(tiny_config(), steps=5)
    for sweep, expect in (
        ("model.d_model=32,33", "not divisible"),
        ("model.d_modl=32", "unknown config key"),
        ("model.d_model", "KEY=v1,v2"),
    ):
        r = run_cli(
            "bench",
            "--run-dir",
            str(tmp_path / "run"),
            "--config",
            "configs/tiny.yaml",
            "--sweep",
            sweep,
        )
        assert r.returncode == 2 and r.stderr.startswith("error: ") and expect in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bench_cli_sweep_writes_table_plot_and_provenance(tmp_path):
    r = run_cli(
        "bench",
        "--run-dir",
        str(tmp_path),
        "--config",
        "configs/tiny.yaml",
        "--set",
        "model.dropout=0",
        "--sweep",
        "model.d_model=32,64",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [row["value"] for row in data["sweep"]["rows"]] == ["32", "64"]
    assert data["sweep"]["rows"][1]["matmul_params"] > data["sweep"]["rows"][0]["matmul_params"]
    assert data["environment"]["backend"] == "cpu" and data["environment"]["git_commit"]
    assert (tmp_path / "bench" / "sweep.png").stat().st_size > 0
    assert "| model.d_model |" in r.stdout
