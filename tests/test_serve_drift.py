"""The serving drift statistic (JSD of the newest prompt bytes against the training corpus): its
alarm fires on text that is not Shakespeare and stays quiet on the held-out plays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tpulab.data.drift import THRESHOLD, WINDOW_BYTES, DriftWindow, byte_histogram, js_divergence

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plays():
    from tpulab.data.config import DataConfig
    from tpulab.data.corpus import load_corpus
    from tpulab.data.pipeline import split_documents

    train, held_out = split_documents(load_corpus(None), DataConfig())
    return sum(byte_histogram(d.data) for d in train), held_out


def _prompts(text: bytes):
    """What a client would send: the text cut into lines, each with its newline (the corpus's
    format; the threshold's measurement, benchmarks/drift_threshold.py, does the same)."""
    return text.splitlines(keepends=True)


def test_divergence_bounds():
    a, b = byte_histogram(b"aaaabbbb"), byte_histogram(b"ccccdddd")
    assert js_divergence(a, a) == 0.0 and js_divergence(a, b) == 1.0
    c = byte_histogram(b"aabbbbcc")
    assert js_divergence(a, c) == pytest.approx(js_divergence(c, a)) and 0 < js_divergence(a, c) < 1
    for bad in (np.zeros(256), -np.ones(256), np.ones(3)):
        with pytest.raises(ValueError):
            js_divergence(a, bad)


def test_alarm_fires_on_text_that_is_not_shakespeare_and_not_on_held_out_plays(plays):
    """Every held-out play line by line: the window (after it first fills) never crosses the
    threshold. This repository's docs and its Python sources, line by line: the alarm is on."""
    reference, held_out = plays
    for doc in held_out:
        w = DriftWindow(reference)
        worst = 0.0
        for p in _prompts(doc.data):
            w.observe(p)
            if w.bytes >= WINDOW_BYTES:
                worst = max(worst, w.value())
                assert not w.alarm(), (doc.name, w.value())
        assert doc.data.__len__() < WINDOW_BYTES or 0 < worst < THRESHOLD, (doc.name, worst)
    docs = b"\n".join(p.read_bytes() for p in sorted((REPO / "docs").glob("*.md")))
    code = b"\n".join(p.read_bytes() for p in sorted((REPO / "src/tpulab/data").glob("*.py")))
    for name, text in (("docs", docs), ("python", code)):
        w = DriftWindow(reference)
        for p in _prompts(text)[:400]:
            w.observe(p)
        assert w.bytes >= WINDOW_BYTES and w.alarm(), (name, w.value())


def test_no_alarm_before_a_full_window_and_old_prompts_leave_it(plays):
    reference, held_out = plays
    w = DriftWindow(reference)
    assert np.isnan(w.value()) and not w.alarm()
    w.observe(b"def f(x):\n    return {'x': [x]}\n")  # far from the plays, but only 32 bytes
    assert w.value() > THRESHOLD and not w.alarm()
    for p in _prompts(b"\n".join(p.read_bytes() for p in (REPO / "docs").glob("*.md")))[:300]:
        w.observe(p)
    assert w.alarm()
    for p in _prompts(held_out[0].data)[:2000]:  # the plays come back: the window forgets the docs
        w.observe(p)
    assert WINDOW_BYTES <= w.bytes < WINDOW_BYTES + 200 and not w.alarm(), w.value()


def test_without_a_reference_there_is_no_statistic():
    w = DriftWindow(None)
    w.observe(b"x" * 5000)
    assert np.isnan(w.value()) and not w.alarm()
    with pytest.raises(ValueError):
        w.set_reference(np.zeros(256))
