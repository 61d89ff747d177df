"""KV cache: int8 quantization, bytes per token, cached path vs full forward, compile-once
decode."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tpulab.model import kvcache as kv


def test_int8_roundtrip_is_bounded_clipped_and_zero_safe():
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 16)).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero vector
    x[1, 1, 1, 3] = 1e6  # an outlier
    q, scale = kv.quantize_int8(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (2, 5, 3, 1)
    assert int(jnp.min(q)) >= -127 and int(jnp.max(q)) <= 127
    assert float(scale[0, 0, 0, 0]) == 1.0
    back = np.asarray(kv.dequantize_int8(q, scale, jnp.float32))
    assert np.all(back[0, 0, 0] == 0.0) and np.all(np.isfinite(back))
    assert np.all(np.abs(back - x) <= np.asarray(scale) / 2 * (1 + 1e-6))


@pytest.mark.parametrize("policy, per_elem", [("fp32", 4), ("bf16", 2), ("int8", 1)])
def test_bytes_per_token_counts_all_layers_and_scales(policy, per_elem):
    layers, heads, head_dim = 3, 2, 8
    cache = kv.init_cache(policy, layers, 2, 16, heads, head_dim)
    scales = 2 * layers * heads * 4 if policy == "int8" else 0
    assert kv.bytes_per_token(cache) == 2 * layers * heads * head_dim * per_elem + scales


@pytest.mark.parametrize("policy", kv.POLICIES)
def test_as_stored_is_what_read_returns_after_write(policy):
    """Prefill attends over ``as_stored`` values instead of reading back the buffer it just wrote:
    they must be bitwise what ``read`` returns after ``write``; and not the raw values, where the
    cache rounds them."""
    rng = np.random.default_rng(1)
    cache = kv.init_cache(policy, 2, 2, 8, 3, 4)
    k = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    k_read, v_read = kv.read(kv.write(cache, 1, k, v, 0), 1, jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(kv.as_stored(cache, k, jnp.float32)), np.asarray(k_read[:, :5])
    )
    np.testing.assert_array_equal(
        np.asarray(kv.as_stored(cache, v, jnp.float32)), np.asarray(v_read[:, :5])
    )
    assert np.array_equal(np.asarray(k_read[:, :5]), np.asarray(k)) == (policy == "fp32")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", kv.POLICIES)
def test_loop_layout_rows_hold_exactly_what_the_exported_layout_holds(policy, batch):
    """The compiled loop's per-layer cache (keys [B*H, Dh, S], values [B*H, S, Dh]): one token per
    row, each row at its own slot, lands in the same (layer, row, slot, head) cells, bitwise, as the
    exported writer puts that row's token there; the layouts differ (so the check can fail) and a
    shifted write is caught."""
    import jax

    rng = np.random.default_rng(0)
    cache = kv.init_cache(policy, 2, batch, 8, 2, 4)
    k = jnp.asarray(rng.normal(size=(batch, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, 2, 4)), jnp.float32)
    start = [0, 3, 6][:batch] if batch > 1 else [5]  # every row at its own position

    def row(b):
        one = jax.tree.map(lambda x: x[:, b : b + 1], cache)
        return kv.write(one, 1, k[b : b + 1, None], v[b : b + 1, None], start[b])

    expected = jax.tree.map(
        lambda *rows: jnp.concatenate(rows, axis=1), *[row(b) for b in range(batch)]
    )
    loop = kv.to_loop_layout(cache)
    assert loop.k[1].shape == (batch * 2, 4, 8) and loop.v[1].shape == (batch * 2, 8, 4)
    want = jax.tree.leaves(
        kv.to_loop_layout(expected)
    )  # the exported writer's cells, in the loop's order
    got = jax.tree.leaves(kv.write_loop(loop, 1, k, v, jnp.asarray(start)))
    assert len(got) == len(want)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
    assert not np.array_equal(
        np.asarray(expected.k), np.asarray(cache.k)
    )  # the write changed something
    shifted = jax.tree.leaves(kv.write_loop(loop, 1, k, v, jnp.asarray(start) + 1))
    assert not all(np.array_equal(np.asarray(w), np.asarray(g)) for w, g in zip(want, shifted))


def test_decode_compiles_once_and_fp32_matches_full_forward(trained_run):
    import jax

    from tpulab.inference.cache_eval import FP32_LOGIT_ATOL
    from tpulab.model.decode import Decoder, ModelFns, pad_prompt
    from tpulab.train.restore import load_model

    fns = ModelFns(load_model(trained_run).model)
    s = fns.shape.max_len
    tokens = np.random.default_rng(1).integers(0, 256, (1, s)).astype(np.int32)
    full = np.asarray(jax.jit(fns.full_logits)(fns.params, tokens))
    dec = Decoder(fns, "fp32")
    prompt = 5
    logits, cache = dec.prefill(pad_prompt(tokens[0, :prompt], s), prompt)
    got = [np.asarray(logits)]
    for pos in range(prompt, s - 1):
        logits, cache = dec.decode(cache, tokens[:, pos], pos)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(
        np.stack(got, 1), full[:, prompt - 1 : s - 1], rtol=0, atol=FP32_LOGIT_ATOL
    )
    assert dec.compiled_variants() == {"prefill": 1, "decode": 1, "generate": 0}


def test_kvcache_command_writes_table_within_bounds(trained_run, tmp_path, capsys):
    from tpulab.cli.main import main
    from tpulab.inference.capstone import bounds

    out = tmp_path / "kv"
    assert main(["kvcache", "--run-dir", str(trained_run), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"kvcache.json", "kvcache.md", "kvcache.png"}
    result = json.loads((out / "kvcache.json").read_text())
    rows = {r["precision"]: r for r in result["rows"]}
    assert set(rows) == {"fp32", "bf16", "int8"}
    for r in rows.values():
        assert {
            "bytes_per_token",
            "ratio_to_fp32",
            "max_abs_logit_diff",
            "mean_kl",
            "greedy_agreement",
            "heldout_loss",
        } <= set(r)
        assert r["greedy_tokens"] >= 256
    assert (
        rows["fp32"]["ratio_to_fp32"] == 1.0
        and rows["int8"]["ratio_to_fp32"] < rows["bf16"]["ratio_to_fp32"] < 1
    )
    assert rows["fp32"]["max_abs_logit_diff"] <= result["fp32_logit_atol"]
    assert rows["bf16"]["max_abs_logit_diff"] < 0.05 and rows["bf16"]["mean_kl"] < 1e-3
    assert rows["int8"]["max_abs_logit_diff"] < 0.1 and rows["int8"]["mean_kl"] < 1e-3
    b = bounds(result)
    assert b["fp32_logit_diff_within_atol"] and b["int8_greedy_agreement_ok"] and b["int8_loss_ok"]
    assert abs(rows["fp32"]["heldout_loss"] - result["reference"]["heldout_loss"]) < 1e-4
    assert (
        result["dtypes"]["weights"] == "float32"
        and result["dtypes"]["cache"]["int8"]["storage_dtype"] == "int8"
    )
    assert "| int8 |" in capsys.readouterr().out


@pytest.mark.slow
def test_int8_bounds_on_default_model(default_run):
    """The issue's bound on the default model: int8 greedy agreement >= 0.99, loss within 1%
    of fp32, on configs/default.yaml trained 100 steps (conftest.default_run; the bound is about
    the cache, not the model's quality). The bounds read the fp32 and int8 rows only, so bf16's
    (a third of the table's cost) is not computed: the table test above covers all three."""
    from tpulab.errors import TpulabError
    from tpulab.inference.cache_eval import KVEvalConfig, kvcache_table
    from tpulab.inference.capstone import bounds
    from tpulab.train.restore import load_model

    for bad in ((), ("int8", "fp32"), ("fp32", "fp8"), ("fp32", "int8", "int8")):
        with pytest.raises(TpulabError, match="fp32 first"):
            KVEvalConfig(policies=bad)
    cfg = KVEvalConfig(windows=4, policies=("fp32", "int8"))
    result = kvcache_table(load_model(default_run), cfg)
    assert [r["precision"] for r in result["rows"]] == ["fp32", "int8"]
    b = bounds(result)
    assert (
        b["fp32_logit_diff_within_atol"] and b["int8_greedy_agreement_ok"] and b["int8_loss_ok"]
    ), result["rows"]


@pytest.mark.parametrize("policy", kv.POLICIES)
def test_decode_step_work_agrees_with_the_compiler_and_the_buffers(policy):
    """The decode table's per-step FLOPs and bytes (``step_work``) are analytic: its FLOPs must
    agree with XLA's cost analysis of one loop decode step, its bytes with the actual weight and
    cache buffers, and both must scale with the batch (a constant, or a count that ignored the
    cache, fails)."""
    import jax
    from flax import nnx

    from conftest import tiny_config
    from tpulab.inference.speed import step_work
    from tpulab.model.decode import ModelFns
    from tpulab.model.transformer import Transformer

    cfg = tiny_config()
    fns = ModelFns(Transformer(cfg.model, cfg.precision, rngs=nnx.Rngs(0)))
    work = {b: step_work(fns, policy, b) for b in (1, 4)}
    cache = kv.to_loop_layout(fns.shape.init(policy, 4))
    buffers = sum(x.nbytes for x in jax.tree.leaves(cache)) + sum(
        x.nbytes for x in fns.params.values()
    )
    assert work[4]["bytes_per_step"] == buffers
    assert work[1]["bytes_per_step"] < work[4]["bytes_per_step"]
    assert abs(work[4]["flops_per_step"] - 4 * work[1]["flops_per_step"]) < 1
    if (
        policy == "fp32"
    ):  # XLA also counts elementwise ops as FLOPs: a bf16 or int8 cache adds converts
        step = jax.jit(fns.decode_rows).lower(
            fns.params, cache, jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32)
        )
        compiled = step.compile().cost_analysis()
        compiled = compiled[0] if isinstance(compiled, list) else compiled
        assert (
            abs(compiled["flops"] - work[4]["flops_per_step"]) <= 0.15 * work[4]["flops_per_step"]
        )
