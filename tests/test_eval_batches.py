"""Fewer validation windows than one batch: one partial batch filled with masked rows, so the loop's
validation loss counts each window exactly once (it used to repeat windows and weigh some twice)."""

from __future__ import annotations

import numpy as np

from conftest import tiny_config
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, eval_batches, to_batch
from tpulab.data.tokenizer import PAD
from tpulab.evidence.ledger import batch_windows, window_sha256
from tpulab.proofs.checks import numpy_masked_nll
from tpulab.train.loop import evaluate
from tpulab.train.step import make_steps


def test_each_window_counts_once_in_the_validation_loss():
    cfg = tiny_config()
    windows = build_splits(load_corpus(None), cfg.data).val_windows[:3]  # batch_size is 8
    batches = eval_batches(windows, cfg.data.batch_size, cfg.train.eval_batches)
    assert len(batches) == 1 and batches[0]["inputs"].shape == (8, 32)
    mask = batches[0]["mask"]
    assert mask[3:].sum() == 0 and (batches[0]["targets"][3:] == PAD).all()
    used = [h for h, m in zip(window_sha256(batch_windows(batches[0])), mask.any(axis=1)) if m]
    assert used == window_sha256(windows)  # each of the 3 windows once, nothing else

    steps = make_steps(cfg)
    params = steps.init().params
    got = evaluate(steps, params, batches)["val_loss"]
    # the reference: the mean NLL over the valid targets of exactly these 3 windows
    exact = to_batch(windows)
    logits = np.asarray(steps.model(params)(exact["inputs"], deterministic=True))
    want = numpy_masked_nll(logits, exact["targets"], exact["mask"])
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    # control: the old repetition (windows 0, 1, 2, 0, 1, 2, 0, 1) weighs windows 0 and 1 three
    # times and window 2 twice, which this model's losses tell apart from the exact mean
    repeated = to_batch(np.concatenate([windows] * 3)[:8])
    old = evaluate(steps, params, [repeated])["val_loss"]
    assert abs(old - want) > 1e-5 * abs(want), (old, want)
