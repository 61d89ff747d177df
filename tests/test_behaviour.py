"""The behaviour suite: its code scorers on scripted engines, its gate, and the CI gate on the
tiny trained model (a regression of the trained model fails this test)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpulab.data.tokenizer import BOS, PAD, VOCAB_SIZE
from tpulab.ops import behaviour as B

# The CI gate's baseline: behaviour.evaluate on configs/tiny.yaml trained 40 steps (the session's
# trained_run), measured at commit 7dc480d on XLA:CPU, jax/jaxlib 0.10.2, fp32 cache. A change that
# makes the trained model worse than this by more than behaviour.MARGINS fails the gate below.
BASELINE = {
    "held_out_loss": 4.245181544954448,
    "stop_rate": 0.0,
    "byte_validity": 1.0,
    "exact_match": 0.0,
}


class Scripted:
    """An Engine in numpy whose next token is ``rule(tokens so far)``: logit 10 there, 0 elsewhere
    (``None``: all 0, a uniform guess). Tests the scorers' arithmetic, not a model."""

    policy, batch = "fp32", 1

    def __init__(self, rule, max_len: int = 64):
        self.rule, self.max_len = rule, max_len

    def _logits(self, seq):
        out = np.zeros((1, VOCAB_SIZE), np.float32)
        t = self.rule([int(x) for x in seq])
        if t is not None:
            out[0, t] = 10.0
        return out

    def prefill(self, tokens_bs, length):
        seq = list(np.asarray(tokens_bs)[0, : int(length)])
        return self._logits(seq), seq

    def decode(self, cache, token_b, pos):
        seq = [*cache[: int(pos)], int(np.asarray(token_b)[0])]
        return self._logits(seq), seq

    def generate(self, tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop):
        b = tokens_bs.shape[0]
        out, n = np.full((b, self.max_len), PAD, np.int32), np.zeros((b,), np.int32)
        for r in range(b):
            seq = list(tokens_bs[r, : lengths_b[r]])
            while n[r] < max_new_b[r]:
                t = int(np.argmax(self._logits(seq)[0]))
                out[r, n[r]], n[r] = t, n[r] + 1
                seq.append(t)
                if t == int(stop):
                    break
        return out, n

    @staticmethod
    def batch_for(n):
        return n

    def width_for(self, n):
        return self.max_len


def script(speaker: bytes | list[int], completions: bool):
    """A rule: after a speaker prompt emit ``speaker`` then newlines; after a completion prompt
    the right word (or "zz" when ``completions`` is False)."""
    table = [(p.encode(), list(speaker)) for p in B.SPEAKERS]
    table += [(p.encode(), list((w if completions else "zz").encode())) for p, w in B.COMPLETIONS]

    def rule(seq):
        text = bytes(t for t in seq if t < 256)
        for prompt, cont in table:
            if seq[:1] == [BOS] and text.startswith(prompt):
                done = len(seq) - 1 - len(prompt)
                return cont[done] if done < len(cont) else ord("\n")
        return None

    return rule


@pytest.mark.parametrize(
    "speaker, completions, want",
    [
        (b"Well, sir.\n", True, {"stop_rate": 1.0, "byte_validity": 1.0, "exact_match": 1.0}),
        (b"\n", False, {"stop_rate": 0.0, "byte_validity": 1.0, "exact_match": 0.0}),
        (b"e" * 80, True, {"stop_rate": 0.0, "byte_validity": 1.0, "exact_match": 1.0}),
        (b"\xff\xfe\n", True, {"stop_rate": 1.0, "byte_validity": 0.0}),
        (b"ring\x07\n", True, {"stop_rate": 1.0, "byte_validity": 0.0}),
        ([ord("a"), BOS, ord("\n")], True, {"stop_rate": 1.0, "byte_validity": 0.0}),
    ],
)
def test_scorers_count_what_the_decodes_did(speaker, completions, want):
    result = B.evaluate(Scripted(script(speaker, completions)))
    for name, value in want.items():
        assert result["scores"][name] == value, (name, result["items"][:2])
    assert result["suite_sha256"] == B.suite_sha256() and len(result["items"]) == 20


def test_held_out_loss_is_the_teacher_forced_nll_per_byte():
    uniform = B.evaluate(Scripted(lambda seq: None))["scores"]["held_out_loss"]
    assert uniform == pytest.approx(math.log(VOCAB_SIZE), abs=1e-9)
    assert B.gate({**BASELINE, "held_out_loss": uniform})  # a uniform guess fails the floor

    passages = [[BOS, *t.encode()] for t in B.HELD_OUT]

    def oracle(seq):  # always puts logit 10 on the passage's next byte
        for p in passages:
            if p[: len(seq)] == seq and len(seq) < len(p):
                return p[len(seq)]
        return None

    result = B.evaluate(Scripted(oracle, max_len=64))
    # Right with logit 10 everywhere but the first byte of passages 2-4 (after [BOS] alone the
    # oracle cannot tell the passages apart and names the first one's).
    z = math.exp(10) + VOCAB_SIZE - 1
    n = sum(min(len(t.encode()), 63) for t in B.HELD_OUT)
    want = ((n - 3) * -math.log(math.exp(10) / z) + 3 * math.log(z)) / n
    assert result["held_out_bytes"] == n
    assert result["scores"]["held_out_loss"] == pytest.approx(want, rel=1e-12)


def test_gate_margins_directions_and_non_finite_scores():
    assert B.gate(BASELINE, BASELINE) == []
    edge = {**BASELINE, "held_out_loss": BASELINE["held_out_loss"] + 0.04, "stop_rate": 0.0}
    assert B.gate(edge, BASELINE) == []
    worse = B.gate({**BASELINE, "held_out_loss": BASELINE["held_out_loss"] + 0.06}, BASELINE)
    assert len(worse) == 1 and worse[0].startswith("held_out_loss") and "margin 0.05" in worse[0]
    two_items = {**BASELINE, "byte_validity": 0.75}
    assert [f.split()[0] for f in B.gate(two_items, BASELINE)] == ["byte_validity"]
    assert B.gate({**BASELINE, "byte_validity": 0.875}, BASELINE) == []  # one item of eight
    better = {**BASELINE, "held_out_loss": 1.0, "exact_match": 1.0}
    assert B.gate(better, BASELINE) == [] and B.gate(BASELINE, better)
    assert "nan" in B.gate({**BASELINE, "stop_rate": float("nan")})[0]


def test_suite_digest_names_its_content(monkeypatch):
    before = B.suite_sha256()
    monkeypatch.setattr(B, "HELD_OUT", (*B.HELD_OUT[:-1], B.HELD_OUT[-1] + "x"))
    assert B.suite_sha256() != before


def _decoder(run_dir, step=None, *, zero=False):
    from tpulab.model.decode import Decoder, ModelFns
    from tpulab.train.restore import load_model

    fns = ModelFns(load_model(run_dir, step).model)
    params = {k: v * 0 for k, v in fns.params.items()} if zero else None
    return Decoder(fns, "fp32", params)


def test_ci_gate_trained_model_passes_and_degraded_models_fail(trained_run):
    scores = B.evaluate(_decoder(trained_run))["scores"]
    assert B.gate(scores, BASELINE) == [], scores

    # A less trained model (the step-20 checkpoint of the same run) is a regression ...
    earlier = B.evaluate(_decoder(trained_run, 20))["scores"]
    failed = B.gate(earlier, BASELINE)
    assert failed and all(f.startswith("held_out_loss") for f in failed), failed
    # ... and so is a deliberately broken one (every weight zeroed: uniform logits, byte 0 emitted).
    broken = B.evaluate(_decoder(trained_run, zero=True))["scores"]
    names = {f.split()[0] for f in B.gate(broken, BASELINE)}
    assert {"held_out_loss", "byte_validity"} <= names, broken
