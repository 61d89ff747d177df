"""``tpulab pairs``: preference pairs sampled from a policy, labelled Bradley-Terry on r*.

For every prompt of the dialogue set (``tpulab.data.dialogue``: a cue speech and the responder's
name, from the training plays, and separately from the held-out plays) the policy samples two
replies through the compiled generation loop (``tpulab.inference.generate.generate_batch``: one
dispatch per batch of prompts, the service's own sampler; temperature 1 unless told otherwise,
each reply keyed by its own seed). A reply ends at the stop byte, or where its room ends (a pair
fits ``data.seq_len`` tokens framed, ``tpulab.data.preference``): then it is stored as not stopping.
A reply the pair format cannot hold (a delimiter or special token, bytes that are not UTF-8) is cut
before that byte and stored as not stopping (a pair with a reply cut to nothing is dropped); two
replies that are the same are no preference and are dropped; all are counted in
``dataset.json``. The two replies are ordered by a seeded
Bradley-Terry draw on r* (``preference.bradley_terry``).

``DIR`` gets ``pairs.jsonl`` (training prompts), ``eval.jsonl`` (held-out prompts) and
``dataset.json``: the policy's run dir, step and checkpoint digest, its shape, the sampling
settings and seed, the labeller's seed, the tokenizer, the sha256 of both files and the counts,
with the gold-optimal accuracy of each split and provenance. ``preference.read_dir`` reads it back
(objective.data: DIR) and its identity hashes all of that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from tpulab.checkpoint.files import atomic_write_json, check_out
from tpulab.config import to_dict
from tpulab.data import dialogue, preference
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import split_documents
from tpulab.data.tokenizer import BOS
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import TpulabError
from tpulab.evidence.provenance import environment
from tpulab.inference.generate import Request, SamplingConfig, generate_batch
from tpulab.model.decode import Decoder
from tpulab.train.objectives.lm import LANGUAGE_MODEL
from tpulab.train.registry import objective_class
from tpulab.train.restore import Restored, load_model

BUILDER = "tpulab-pairs-v1"
# A prompt's cue is cut so that its replies get at least max(MIN_ROOM, seq_len // 5) tokens, stop
# included: 6 at the tiny test size (32), 25 at the default 128.
MIN_ROOM = 4
CHUNK = 32  # requests per dispatch of the compiled loop


@dataclasses.dataclass(frozen=True)
class PairsConfig:
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0  # sampling seed: reply k of prompt i draws with its own key
    labeller_seed: int = 0
    train_prompts: int = 1024  # at most this many training prompts (a seeded choice); 0 = all
    eval_prompts: int = 256  # the same for the held-out prompts


def load_policy(run_dir: str | Path) -> Restored:
    """The newest verified checkpoint of ``run_dir``, a run whose objective produces a language
    model (a policy that generates; a reward model only scores)."""
    policy = load_model(run_dir)
    produces = objective_class(policy.config.objective.kind).produces
    if produces != LANGUAGE_MODEL:
        raise TpulabError(f"{run_dir} is a {produces}, not a policy: it cannot generate")
    return policy


def prompts_of(docs, seq_len: int) -> list[bytes]:
    """Each cue -> responder prompt of the plays, once, cut from the left so that a reply has at
    least ``max(MIN_ROOM, seq_len // 5)`` tokens within ``seq_len`` framed."""
    out, seen = [], set()
    reserve = b"x" * (max(MIN_ROOM, seq_len // 5) - 1)  # the reply's room, less its stop byte
    for doc in docs:
        for pair in dialogue.play_pairs(doc):
            # fit() leaves seq_len + 1 tokens; one fewer keeps the last byte an input
            fitted = dialogue.fit(dialogue.Pair(pair.prompt, reserve, ""), seq_len - 1)
            if fitted is not None and fitted.prompt not in seen:
                seen.add(fitted.prompt)
                out.append(fitted.prompt)
    return out


def prompt_tokens(prompt: bytes) -> np.ndarray:
    """What the policy reads before its reply: BOS SOH prompt STX."""
    framed = bytes([dialogue.PROMPT_START]) + prompt + bytes([dialogue.RESPONSE_START])
    return np.concatenate([[BOS], np.frombuffer(framed, np.uint8)]).astype(np.int32)


def room(prompt: bytes, seq_len: int) -> int:
    """Tokens a reply may take (its stop byte included) in ``seq_len`` framed, at most
    ``MAX_REPLY + 1`` (r* counts a stop past MAX_REPLY bytes as missing)."""
    return min(preference.MAX_REPLY + 1, seq_len - len(prompt_tokens(prompt)))


def as_reply(tokens: list[int]) -> tuple[bytes, bool, bool]:
    """(reply, stops, cut): generated tokens as a storable reply, without its stop byte; ``cut``
    when it held something the pair format cannot (a delimiter, a special token, not UTF-8)."""
    body, stops, cut = bytearray(), False, False
    for t in tokens:
        if t == dialogue.STOP:
            stops = True
            break
        if t >= 256 or t in dialogue.DELIMITERS:
            cut = True
            break
        body.append(t)
    reply = bytes(body)
    try:
        reply.decode("utf-8")
    except UnicodeDecodeError as e:
        reply, cut = reply[: e.start], True
    return reply, stops and not cut, cut


def sample(
    policy: Restored, prompts: list[bytes], seeds: list[int], cfg: PairsConfig, seq_len: int
) -> list[tuple[bytes, bool, bool]]:
    """One reply per (prompt, seed) through the compiled generation loop."""
    engine = Decoder.of(policy.model, "fp32")
    out = []
    for i in range(0, len(prompts), CHUNK):
        reqs = [
            Request(
                prompt_tokens(p),
                SamplingConfig(
                    max_new=room(p, seq_len),
                    temperature=cfg.temperature,
                    top_k=cfg.top_k,
                    seed=s,
                ),
            )
            for p, s in zip(prompts[i : i + CHUNK], seeds[i : i + CHUNK])
        ]
        out += [as_reply(t) for t in generate_batch(engine, reqs, stop_token=dialogue.STOP)]
    return out


def label(prompts, replies, rng: np.random.Generator) -> tuple[list[preference.Pref], dict]:
    """Bradley-Terry pairs of each prompt's two replies (``replies[2i]``, ``replies[2i + 1]``)."""
    prefs, counts = [], {"prompts": len(prompts), "identical_dropped": 0, "empty_dropped": 0}
    for i, prompt in enumerate(prompts):
        (a, a_stops, _), (b, b_stops, _) = replies[2 * i], replies[2 * i + 1]
        if (a, a_stops) == (b, b_stops):
            counts["identical_dropped"] += 1
            continue
        if (not a and not a_stops) or (not b and not b_stops):  # cut at its first token
            counts["empty_dropped"] += 1
            continue
        first = preference.replied(a, a_stops)
        chosen, _ = preference.bradley_terry(prompt, first, preference.replied(b, b_stops), rng)
        w, lo = ((a, a_stops), (b, b_stops)) if chosen == first else ((b, b_stops), (a, a_stops))
        prefs.append(preference.Pref(prompt, w[0], lo[0], "sampled", w[1], lo[1]))
    counts.update(
        pairs=len(prefs),
        replies_cut=sum(r[2] for r in replies),
        replies_not_stopping=sum(not r[1] for r in replies),
        gold_optimal_accuracy=preference.gold_optimal_accuracy(prefs),
        gold_reward_mean=float(np.mean([r for p in prefs for r in p.rewards()]))
        if prefs
        else float("nan"),
    )
    return prefs, counts


def choose(prompts: list[bytes], n: int, rng: np.random.Generator) -> list[bytes]:
    if not n or n >= len(prompts):
        return prompts
    return [prompts[i] for i in sorted(rng.choice(len(prompts), n, replace=False))]


def make_pairs(policy_dir: str | Path, out: str | Path, cfg: PairsConfig = PairsConfig()) -> dict:
    """Sample, label and write ``out``; returns dataset.json's content. ``out`` must not hold a
    dataset already; it is written whole into a temporary sibling and renamed into place."""
    out = check_out(out)
    SamplingConfig(max_new=1, temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed)
    if not 0 <= cfg.seed < 2**31 or not 0 <= cfg.labeller_seed < 2**32:
        raise TpulabError("--seed must be in [0, 2**31) and --labeller-seed in [0, 2**32)")
    policy = load_policy(policy_dir)
    data_cfg = policy.config.data
    corpus = load_corpus(data_cfg.path)
    dialogue.check_no_delimiters(corpus)
    train_docs, eval_docs = split_documents(corpus, data_cfg)
    pick = np.random.default_rng(cfg.seed)
    splits = {
        "train": choose(prompts_of(train_docs, data_cfg.seq_len), cfg.train_prompts, pick),
        "eval": choose(prompts_of(eval_docs, data_cfg.seq_len), cfg.eval_prompts, pick),
    }
    labeller = np.random.default_rng(cfg.labeller_seed)
    written, counts = {}, {}
    for offset, (split, prompts) in zip((0, 2**30), splits.items()):
        if not prompts:
            raise TpulabError(f"no {split} prompt fits data.seq_len={data_cfg.seq_len}")
        # reply k of prompt i: seed (seed << 32) | (offset + 2i + k), distinct for every reply
        seeds = [(cfg.seed << 32) | (offset + j) for j in range(2 * len(prompts))]
        replies = sample(policy, [p for p in prompts for _ in (0, 1)], seeds, cfg, data_cfg.seq_len)
        prefs, counts[split] = label(prompts, replies, labeller)
        if not prefs:
            raise TpulabError(f"every {split} prompt's two replies were the same: no preference")
        written[split] = prefs
    record = {
        "builder": BUILDER,
        "policy": {
            "run_dir": str(policy_dir),
            "step": policy.step,
            "checkpoint_digest": policy.checkpoint_digest,
            "objective": policy.config.objective.kind,
            "model": to_dict(policy.config.model),
        },
        "sampling": {
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "seed": cfg.seed,
            "loop": "tpulab.inference.generate.generate_batch (compiled), fp32 KV cache",
        },
        "labeller_seed": cfg.labeller_seed,
        "tokenizer": TOKENIZER,
        "seq_len": data_cfg.seq_len,
        "corpus_identity": corpus.identity,
        "split": {"split_seed": data_cfg.split_seed, "val_fraction": data_cfg.val_fraction},
        "counts": counts,
        "environment": environment(),
    }
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        files = {}
        for split, name in (("train", preference.TRAIN_FILE), ("eval", preference.EVAL_FILE)):
            raw = preference.write_jsonl(tmp / name, written[split])
            files[name] = hashlib.sha256(raw).hexdigest()
        record["files"] = files
        atomic_write_json(tmp / preference.DATASET_FILE, record)
        preference.read_dir(tmp, data_cfg)  # what was written reads back (every line checked)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    record["identity"] = preference.read_dir(out, data_cfg).identity
    return record


def summary_line(record: dict) -> str:
    c = record["counts"]
    return (
        f"pairs: {c['train']['pairs']} train, {c['eval']['pairs']} eval (identical dropped: "
        f"{c['train']['identical_dropped']} + {c['eval']['identical_dropped']}); gold-optimal "
        f"accuracy {c['train']['gold_optimal_accuracy']:.3f} train, "
        f"{c['eval']['gold_optimal_accuracy']:.3f} eval; identity {record['identity'][:12]}…"
    )
