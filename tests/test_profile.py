"""`tpulab profile`: a real trace of warmed steps, a top-ops table read from it, categories from the HLO."""

from __future__ import annotations

import json

from conftest import run_cli


def test_hlo_categories_come_from_the_compiled_module():
    import jax
    import jax.numpy as jnp

    from tpulab.perf.profile import hlo_categories

    def f(a, b):
        return jnp.tanh(a @ b).T.copy() + 1.0, jnp.exp(a).sum()

    hlo = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((32, 48))).compile().as_text()
    cats = hlo_categories(hlo)
    assert "matmul" in cats.values()  # the dot, alone or inside a fusion
    assert "matmul" not in {c for name, c in cats.items() if name.startswith(("exp", "reduce", "wrapped_exp"))}
    # Control: a module without a dot has no matmul at all.
    plain = jax.jit(lambda a: jnp.exp(a).sum()).lower(jnp.ones((64, 32))).compile().as_text()
    assert "matmul" not in hlo_categories(plain).values()


def test_profile_traces_steps_and_builds_a_top_ops_table(trained_run):
    from tpulab.perf.profile import profile_run

    r = profile_run(trained_run, steps=3, warmup=2, timed=20)
    assert r["profiled_steps"] == 3 and len(r["profiled_step_times_s"]) == 3
    assert r["op_time_source"] == "host"  # XLA:CPU: no device plane holds the step's ops
    assert (trained_run / r["xplane"]).stat().st_size > 0 and r["perfetto"]
    assert r["categories"]["rng (random bits)"]["ms_per_step"] > 0  # tiny.yaml trains with dropout
    assert r["categories"]["matmul"]["ms_per_step"] > 0 and r["categories"]["fusion"]["ms_per_step"] > 0
    assert r["ops"] and all(o["ms_per_step"] > 0 for o in r["ops"])
    assert {o["category"] for o in r["ops"]} <= {"matmul", "fusion", "copy/transposition", "collective", "rng (random bits)",
                                                "other"}
    saved = json.loads((trained_run / "profile" / "profile.json").read_text())
    assert saved["unprofiled"]["steps"] == 20 and saved["environment"]["backend"] == "cpu"


def test_profile_of_a_run_without_checkpoints_is_one_line(tmp_path):
    r = run_cli("profile", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "no checkpoints" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "profile").exists()
