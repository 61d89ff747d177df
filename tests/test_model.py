"""The independent checks, run on a fresh init here (the CLI runs them on trained weights)."""

import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits
from tpulab.proofs.checks import check_causal, check_loss, numpy_masked_nll
from tpulab.train.step import make_steps, masked_xent


def _model(*overrides):
    steps = make_steps(tiny_config(*overrides))
    return steps.model(steps.init().params)


def test_causal_attention_holds_bitwise():
    results = check_causal(_model(), seq_len=32, vocab=258)
    assert all(r["passed"] for r in results), results


def test_causal_check_catches_a_leaky_mask(monkeypatch):
    """The check can fail: with the causal mask replaced by all-True it must report failure."""
    from tpulab.model import transformer

    monkeypatch.setattr(transformer, "causal_mask", lambda q, k, q_offset=0: jnp.ones((q, k), bool))
    results = check_causal(_model(), seq_len=32, vocab=258)
    assert not results[0]["passed"]


def test_valid_token_loss_matches_numpy_and_ignores_padding():
    cfg = tiny_config()
    splits = build_splits(load_corpus(None), cfg.data)
    results = check_loss(_model(), splits.train_windows)
    assert all(r["passed"] for r in results), results


def test_masked_xent_reference_on_random_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 5)).astype(np.int32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    ours, count = jax.jit(masked_xent)(logits, targets, mask)
    assert int(count) == 8
    np.testing.assert_allclose(float(ours), numpy_masked_nll(logits, targets, mask), rtol=1e-6)


def test_bf16_compute_keeps_fp32_logits_and_params():
    model = _model("precision.compute_dtype=bfloat16")
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32
    assert model.blocks[0].attn.qkv.kernel[...].dtype == jnp.float32
