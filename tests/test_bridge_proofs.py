"""End to end, with real subprocesses: kill/resume proofs on every bridge this machine runs, the
negative control, and the cross-runtime comparison. Small sizes; still run in CI (`make test`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tpulab.bridge import checkpoint as C
from tpulab.bridge.backends import torch_xla_problem
from tpulab.bridge.config import BridgeConfig
from tpulab.errors import TpulabError

# augment and dropout on: the resume is exact only if every generator state is restored
PROOF = BridgeConfig(n=64, steps=16, checkpoint_every=5, augment=0.1, dropout=0.1)


@pytest.fixture(scope="module", autouse=True)
def shared_jax_cache(tmp_path_factory):
    """Children of this module's tests share one JAX compilation cache (the proof's env is
    os.environ), except each proof's resumed process, which gets a fresh one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jax-cache"))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        yield


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, method", [("torch", "eager"), ("torchax", "eager"), ("torchax", "jit")]
)
def test_prove_resume_bitwise(tmp_path, backend, method):
    from tpulab.bridge.prove import prove

    # Only torchax eager's resume compiles cold (the cold-path assertion below): torchax jit's
    # resumed process shares the warm cache, and torch alone compiles nothing through JAX.
    warm = (backend, method) == ("torchax", "jit")
    v = prove(PROOF, backend, method, tmp_path, timeout_s=180, warm_resume_cache=warm, track=False)
    assert v["identical"], v
    assert v["kill_step"] == 11 and v["resumed_from_step"] == 10 and v["steps_compared"] == 16
    # the whole final state, not only the curves (model, optimizer, step, generator states)
    assert v["curves_identical"] and v["final_state_identical"] and v["leaves_compared"] >= 10
    assert "rng (torch_cpu, augment)" in v["final_state_compared"]
    resumed = v["compile_cache"]["processes"]["resumed"]
    assert resumed["cold"] is not warm
    if warm:  # it read the programs the reference and killed runs compiled
        assert resumed["hits"] > 0 and "cold_confirmed" not in resumed
    elif backend == "torchax":  # torch alone compiles nothing through JAX
        # its cache was empty at its first lookup; torchax eager builds some op twice, and the
        # second build hits the first one's entry: a hit of its own, never another process's
        assert resumed["entries_at_first_lookup"] == 0 and resumed["cold_confirmed"] is True
        assert resumed["misses"] > 0
    on_disk = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert on_disk["identical"] and on_disk["signal"] == "SIGKILL"
    assert (tmp_path / "proof" / "overlay.png").stat().st_size > 10_000
    report = (tmp_path / "proof" / "report.md").read_text()
    assert "bitwise identical" in report and "overlay.png" in report and "not a TPU" in report
    # the checkpoint carries the generator states
    state = C.load_state(C.latest(tmp_path / "proof" / "interrupted"))
    assert set(state["rng"]) == {"torch_cpu", "augment"}
    assert ("device_rng" in state) == (backend == "torchax")


@pytest.mark.slow
def test_negative_control_is_caught(tmp_path):
    from tpulab.bridge.prove import prove

    v = prove(PROOF, "torch", "eager", tmp_path, restore_rng=False, timeout_s=180, track=False)
    assert v["identical"] is False
    assert v["first_differing_step"] == v["resumed_from_step"] + 1
    assert v["first_differing_step_before_kill"] is None
    assert v["final_state_identical"] is False and v["first_differing_leaf"].startswith("['model']")
    assert "NOT identical: caught" in (tmp_path / "proof" / "report.md").read_text()


@pytest.mark.slow
def test_compare_torchax_agrees_with_torch_at_step_200(tmp_path):
    from tpulab.bridge.compare import compare

    # the defaults (200 steps), one checkpoint at the end: the comparison reads only the curves
    cfg = BridgeConfig(checkpoint_every=200)
    assert cfg.steps == 200 and dataclasses.replace(cfg, checkpoint_every=10) == BridgeConfig()
    out = compare(cfg, tmp_path, timeout_s=300, track=False)
    rows = {
        (r["backend"], r["method"]): r
        for r in json.loads((tmp_path / "compare.json").read_text())["rows"]
    }
    assert {("torch", "eager"), ("torchax", "eager"), ("torchax", "jit")} <= set(rows)
    for r in rows.values():
        assert set(r) >= {
            "backend",
            "method",
            "final_loss",
            "max_rel_diff_vs_float64",
            "max_abs_diff_vs_torch",
            "rel_diff_final",
        }
        # every row, torch's too, against the independent float64 NumPy reference
        assert r["within_tolerance"] is True and r["rel_diff_final_vs_float64"] < 1e-4, r
    torch_row = rows.pop(("torch", "eager"))
    assert torch_row["max_abs_diff_vs_torch"] is None  # torch is not compared with itself
    assert all(r["rel_diff_final"] < 1e-4 for r in rows.values()), rows
    assert (
        "| torchax | jit |" in (tmp_path / "compare.md").read_text()
        and "| torchax | jit |" in out["markdown"]
    )
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    with pytest.raises(TpulabError, match="already holds a comparison"):
        compare(cfg, tmp_path)


@pytest.mark.skipif(torch_xla_problem() is not None, reason=str(torch_xla_problem()))
@pytest.mark.tpu
def test_prove_resume_torch_xla(tmp_path):
    from tpulab.bridge.prove import prove

    assert prove(PROOF, "torch_xla", "eager", tmp_path, timeout_s=600)["identical"]


def test_a_reused_reference_must_be_the_same_finished_uninterrupted_run(tmp_path):
    """The negative control reuses torch/eager's reference; a run of another config, backend or
    method, a resumed one or an unfinished one is refused (each a control of the accepted one)."""
    from tpulab.bridge.prove import check_reference
    from tpulab.config import to_dict

    def run(name, *, cfg=PROOF, backend="torch", steps=PROOF.steps, resumed=False):
        d = tmp_path / name
        d.mkdir()
        start = {"event": "start", "backend": backend, "method": "eager", "config": to_dict(cfg)}
        recs = [{**start, "segment": 0, "resumed_from": None}]
        recs += [{"step": s, "loss": 1.0, "segment": 0} for s in range(1, steps + 1)]
        if resumed:
            recs.append({**start, "segment": 1, "resumed_from": 5})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return d

    assert check_reference(run("same"), PROOF, "torch", "eager") == tmp_path / "same"
    for d, what in (
        (run("other-config", cfg=dataclasses.replace(PROOF, seed=1)), "another config"),
        (run("other-backend", backend="torchax"), "another config"),
        (run("resumed", resumed=True), "was resumed"),
        (run("short", steps=PROOF.steps - 1), "did not log every step"),
        (tmp_path / "none", "holds no bridge run"),
    ):
        with pytest.raises(TpulabError, match=what):
            check_reference(d, PROOF, "torch", "eager")
