"""The independent checks, run on a fresh init here (the CLI runs them on trained weights)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def _loss_check(steps=None):
    cfg = tiny_config()
    steps = steps or make_steps(cfg)
    windows = build_splits(load_corpus(None), cfg.data).train_windows
    return check_loss(steps, steps.init(), windows, cfg.data.batch_size)


def test_the_steps_loss_matches_numpy_and_ignores_padding():
    results = _loss_check()
    assert all(r["passed"] for r in results), results
    assert "Steps.eval" in results[0]["detail"] and "bitwise unchanged" in results[1]["detail"]


@pytest.mark.parametrize("which", ["eval", "train", "both"])
def test_loss_check_fails_on_a_mask_ignoring_loss(which):
    """Negative control: the real steps fed an all-ones mask (a loss that ignores padding) fail the
    check of the step they replace, through the jitted functions the loop calls."""
    steps = make_steps(tiny_config())
    ones = lambda b: {**b, "mask": jnp.ones_like(b["mask"])}  # noqa: E731
    bad = dataclasses.replace(
        steps,
        eval=(lambda p, b: steps.eval(p, ones(b))) if which != "train" else steps.eval,
        train=(lambda s, b: steps.train(s, ones(b))) if which != "eval" else steps.train,
    )
    eval_row, train_row = _loss_check(bad)
    assert eval_row["passed"] is (which == "train"), eval_row
    assert train_row["passed"] is (which == "eval"), train_row


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
