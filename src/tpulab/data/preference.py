"""Preference pairs with a known truth: a gold reward computable from bytes, and pair datasets.

The gold reward ``r*(prompt, reply)`` scores a reply from its bytes alone, so every stage after SFT
can be measured against the truth: a reward model's accuracy against the best achievable, DPO's
implicit reward against r*, PPO's gold reward against its proxy (Gao et al., arXiv:2210.10760).
It rewards what a good reply in this format does and an untrained policy does not: it stops, its
lines are verse-like (``LINE_BAND``: the corpus's verse lines have a median of 38 bytes), it names
the cue's speaker, and it is text; ``gold_reward`` states every rule exactly (as does
docs/posttraining.md). So r* lies in [-1, 2.5].

Pairs are stored as prompt / chosen / rejected byte strings (prompt framed as in
``tpulab.data.dialogue``: it ends with the responder's name; replies exclude the stop byte, which
the encoding appends) and, per reply, whether it stops: a reply sampled from a policy that
ran out of room without the stop byte is kept as it is (``*_stops`` false: no stop byte is
appended, and r* sees none). Two datasets are built here without a model: *natural* pairs (the
true reply against a length-matched reply from the same scene, ordered by r* with a seeded
Bradley-Terry draw) and user pairs from a JSONL file; pairs sampled from a policy are built by
``tpulab pairs`` (it needs the generation loop) and stored in the same JSONL form, in a directory
with its ``dataset.json`` (``read_dir``).

Every pair fits ``seq_len`` tokens framed (one fewer than an SFT pair may take), so the last
response byte is an *input* position as well as a target: a reward model reads its score there
(``read_positions``), and the stop byte is what it has seen last. Batches lay each pair out as two
consecutive rows, chosen then rejected (``to_batch``): one forward over ``2B`` rows, and the
window ledger and the mask checks see ordinary ``inputs`` / ``targets`` / ``mask`` rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from tpulab.data import dialogue, jsonl
from tpulab.data.config import DataConfig
from tpulab.data.corpus import Corpus
from tpulab.data.heldout import HeldOutSet, hash_fields, identity_hash
from tpulab.data.pipeline import split_documents
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.data.tokenizer import PAD
from tpulab.errors import TpulabError

MAX_REPLY = 96  # bytes a reply may take before its stop byte counts as missing
LINE_BAND = (20, 60)  # verse-like line lengths, bytes
BUILDER = "tpulab-preference-v2"  # v2: per-reply stops, pairs fit seq_len tokens
_PRINTABLE = set(range(0x20, 0x7F)) | {0x09, 0x0A}


def cue_speaker(prompt: bytes) -> bytes:
    """The speaker of a dialogue prompt's cue (its first line, without the full stop)."""
    return prompt.split(b"\n", 1)[0].rstrip(b".")


def gold_reward(prompt: bytes, reply: bytes) -> float:
    """r*(prompt, reply) in [-1, 2.5]; ``reply`` is what follows STX, with or without a stop byte.

    The body is the bytes before the first stop byte (ETX), wherever it is, else the first
    ``MAX_REPLY`` bytes; nothing else of the reply counts. The sum of:

    - +1 if the first stop byte is at offset <= ``MAX_REPLY`` (a bare stop byte stops);
    - the share of counted lines (the body split at LF; a line counts when it holds a byte other
      than ASCII whitespace) whose byte length is in ``LINE_BAND``, both ends inclusive; 0 when
      no line counts;
    - +0.5 if the cue speaker's first 4 bytes, ASCII-lowercased, occur in the lowercased body
      not right after a byte a-z (an empty stem never names);
    - -1 if a body byte is not printable ASCII (0x20-0x7E), tab or LF (CR, and every byte from
      0x80 up, such as UTF-8 "é", is not).
    """
    stop = reply.find(bytes([dialogue.STOP]))
    stopped = 0 <= stop <= MAX_REPLY
    body = reply[:stop] if stop >= 0 else reply[:MAX_REPLY]
    lines = [line for line in body.split(b"\n") if line.strip()]
    lo, hi = LINE_BAND
    verse = sum(lo <= len(line) <= hi for line in lines) / len(lines) if lines else 0.0
    stem = cue_speaker(prompt)[:4].lower()
    named = bool(stem) and re.search(rb"(?<![a-z])" + re.escape(stem), body.lower()) is not None
    text = all(b in _PRINTABLE for b in body)
    return float(stopped) + verse + 0.5 * float(named) - (0.0 if text else 1.0)


@dataclasses.dataclass(frozen=True)
class Pref:
    prompt: bytes
    chosen: bytes
    rejected: bytes
    source: str
    chosen_stops: bool = True  # False: the reply ran out of room before its stop byte
    rejected_stops: bool = True

    def rewards(self) -> tuple[float, float]:
        """(r*(chosen), r*(rejected)), each reply with its stop byte when it has one."""
        return (
            gold_reward(self.prompt, replied(self.chosen, self.chosen_stops)),
            gold_reward(self.prompt, replied(self.rejected, self.rejected_stops)),
        )


def replied(reply: bytes, stops: bool) -> bytes:
    """A stored reply as the policy's stream after STX: with the stop byte when it stops."""
    return reply + bytes([dialogue.STOP]) if stops else reply


def tokens_needed(prompt: bytes, reply: bytes, stops: bool) -> int:
    """Tokens a framed pair side takes: BOS SOH prompt STX reply [ETX]."""
    return 3 + len(prompt) + len(reply) + int(stops)


def bradley_terry(
    prompt: bytes, a: bytes, b: bytes, rng: np.random.Generator
) -> tuple[bytes, bytes]:
    """(chosen, rejected): ``a`` is chosen with probability sigmoid(r*(a) - r*(b))."""
    p = 1.0 / (1.0 + math.exp(gold_reward(prompt, b) - gold_reward(prompt, a)))
    return (a, b) if rng.random() < p else (b, a)


def gold_optimal_accuracy(prefs: list[Pref]) -> float:
    """The best accuracy any reward model can reach on Bradley-Terry labels drawn from r*: the
    mean over pairs of max(p, 1 - p), p = sigmoid(r*(chosen) - r*(rejected))."""
    if not prefs:
        return float("nan")
    acc = 0.0
    for pr in prefs:
        chosen, rejected = pr.rewards()
        p = 1.0 / (1.0 + math.exp(rejected - chosen))
        acc += max(p, 1.0 - p)
    return acc / len(prefs)


def natural_pairs(docs, seq_len: int, seed: int) -> list[Pref]:
    """Per consecutive (cue, reply) in a scene: the true reply against another speech of the same
    scene whose length is closest to it, ordered by a Bradley-Terry draw on r* (both are whole
    speeches: each stops); both must fit ``seq_len`` tokens framed."""
    rng = np.random.default_rng(seed)
    out = []
    for doc in docs:
        for scene in dialogue.scenes(doc):
            for i, (cue, reply) in enumerate(zip(scene, scene[1:])):
                if cue.speaker == reply.speaker:
                    continue
                others = [
                    s for j, s in enumerate(scene) if j not in (i, i + 1) and s.text != reply.text
                ]
                if not others:
                    continue
                other = min(others, key=lambda s: (abs(len(s.text) - len(reply.text)), s.text))
                prompt = cue.speaker + b".\n" + cue.text + b"\n\n" + reply.speaker + b".\n"
                longest = max(reply.text, other.text, key=len)
                # fit() leaves seq_len + 1 tokens; one fewer keeps the stop byte an input
                fitted = dialogue.fit(dialogue.Pair(prompt, longest, doc.name), seq_len - 1)
                if fitted is None:
                    continue
                stop = bytes([dialogue.STOP])
                a, b = bradley_terry(fitted.prompt, reply.text + stop, other.text + stop, rng)
                out.append(Pref(fitted.prompt, a[:-1], b[:-1], doc.name))
    return out


class Preferences(HeldOutSet):
    """The train and evaluation pairs (tuples of ``Pref``), and what they are."""

    builder, unit = BUILDER, "pairs"

    def facts(self) -> dict:
        return {"eval_gold_optimal_accuracy": gold_optimal_accuracy(list(self.eval))}


def identity_of(params: dict, train, evals) -> str:
    h = identity_hash(BUILDER, params)
    for part, prefs in (("train", train), ("eval", evals)):
        h.update(part.encode())
        for p in prefs:
            hash_fields(h, (p.prompt, p.chosen, p.rejected))
            h.update(bytes([p.chosen_stops, p.rejected_stops]))
    return h.hexdigest()


def from_plays(corpus: Corpus, cfg: DataConfig, seed: int = 0) -> Preferences:
    """Natural pairs; evaluation pairs from the pretraining validation plays."""
    dialogue.check_no_delimiters(corpus)
    train_docs, val_docs = split_documents(corpus, cfg)
    train = natural_pairs(train_docs, cfg.seq_len, seed)
    evals = natural_pairs(val_docs, cfg.seq_len, seed + 1)
    params = {
        "source": "natural",
        "corpus_identity": corpus.identity,
        "seq_len": cfg.seq_len,
        "split_seed": cfg.split_seed,
        "val_fraction": cfg.val_fraction,
        "labeller_seed": seed,
    }
    return checked(
        Preferences(tuple(train), tuple(evals), params, identity_of(params, train, evals))
    )


def _read_lines(path: Path, cfg: DataConfig) -> tuple[bytes, list[Pref]]:
    """(file bytes, pairs) of a preference JSONL file; the first bad line is refused by number."""
    raw = jsonl.read_bytes(path, "preference data")
    prefs = []
    for where, rec in jsonl.records(path, raw, ("prompt", "chosen", "rejected")):
        stops = []
        for key in ("chosen_stops", "rejected_stops"):
            value = rec.get(key, True)
            if not isinstance(value, bool):
                raise TpulabError(f"{where}: '{key}' must be true or false, not {value!r}")
            stops.append(value)
        p = Pref(
            rec["prompt"].encode(), rec["chosen"].encode(), rec["rejected"].encode(), where, *stops
        )
        for side, stop in zip(("chosen", "rejected"), stops):
            if not getattr(p, side) and not stop:
                raise TpulabError(f"{where}: the {side} reply is empty and does not stop")
        if (p.chosen, p.chosen_stops) == (p.rejected, p.rejected_stops):
            raise TpulabError(f"{where}: chosen equals rejected (the pair prefers nothing)")
        bad = set(p.prompt + p.chosen + p.rejected) & set(dialogue.DELIMITERS)
        if bad:
            raise TpulabError(f"{where}: holds byte 0x{min(bad):02x}, a delimiter of the format")
        for reply, stop in ((p.chosen, p.chosen_stops), (p.rejected, p.rejected_stops)):
            n_tokens = tokens_needed(p.prompt, reply, stop)
            if n_tokens > cfg.seq_len:
                raise TpulabError(
                    f"{where}: prompt and reply take {n_tokens} tokens framed, more than "
                    f"data.seq_len = {cfg.seq_len} (a preference pair keeps its last byte an "
                    "input: the reward model reads it)"
                )
        prefs.append(p)
    return raw, prefs


def read_jsonl(
    path: str | Path, cfg: DataConfig, extra: dict | None = None, eval_fraction: float = 0.1
) -> Preferences:
    """``{"prompt", "chosen", "rejected"}`` per line (replies without the stop byte; optional
    ``chosen_stops`` / ``rejected_stops`` booleans, default true: a reply that ran out of room is
    false); a bad line is refused with its number: invalid JSON or UTF-8, a missing field, an
    empty reply that does not stop, chosen equal to rejected, a delimiter byte, a pair longer than
    ``data.seq_len`` tokens. The last ``ceil(eval_fraction * n)`` pairs are held out. ``extra``
    joins the identity (a sampled set's policy digest and labeller seed)."""
    path = Path(path)
    raw, prefs = _read_lines(path, cfg)
    train, evals, params = jsonl.held_out(path, raw, prefs, cfg.seq_len, eval_fraction)
    params.update(extra or {})
    return checked(
        Preferences(tuple(train), tuple(evals), params, identity_of(params, train, evals))
    )


# A sampled set's directory (``tpulab pairs --out DIR``): dataset.json names what made the pairs.
DATASET_FILE, TRAIN_FILE, EVAL_FILE = "dataset.json", "pairs.jsonl", "eval.jsonl"


def read_dir(path: str | Path, cfg: DataConfig) -> Preferences:
    """A directory ``tpulab pairs`` wrote: ``pairs.jsonl`` (train), ``eval.jsonl`` (held-out
    prompts' pairs) and ``dataset.json``, whose recorded sha256 of each file must match (a
    changed or corrupt file is refused) and whose tokenizer must be this one. The identity hashes
    the policy's checkpoint digest, the sampling and labelling seeds and every pair."""
    path = Path(path)
    meta_path = path / DATASET_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except OSError as e:
        raise TpulabError(f"cannot read {meta_path}: {e.strerror}") from None
    except ValueError as e:
        raise TpulabError(f"{meta_path} is not valid JSON ({e}): a corrupt dataset") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise TpulabError(f"{meta_path} names no files: not a dataset written by tpulab pairs")
    if meta.get("tokenizer") != TOKENIZER:
        raise TpulabError(
            f"{meta_path}: the pairs were encoded with another tokenizer "
            f"({meta.get('tokenizer')!r}, this one is {TOKENIZER!r})"
        )
    splits = []
    for name in (TRAIN_FILE, EVAL_FILE):
        raw, prefs = _read_lines(path / name, cfg)
        want = meta["files"].get(name)
        if hashlib.sha256(raw).hexdigest() != want:
            raise TpulabError(
                f"{path / name} does not match the sha256 {str(want)[:12]}… that {DATASET_FILE} "
                "records: a changed or corrupt dataset"
            )
        splits.append(prefs)
    train, evals = splits
    params = {
        "source": "sampled",
        "seq_len": cfg.seq_len,
        "files": meta["files"],
        **{k: meta.get(k) for k in ("policy", "sampling", "labeller_seed")},
    }
    return checked(
        Preferences(tuple(train), tuple(evals), params, identity_of(params, train, evals))
    )


def load(data: str | Path | None, corpus: Corpus | None, cfg: DataConfig) -> Preferences:
    """``objective.data``: None = natural pairs from ``corpus``; a directory = sampled pairs
    (``read_dir``); a file = a user's JSONL (``read_jsonl``)."""
    if data is None:
        return from_plays(corpus, cfg)
    return read_dir(data, cfg) if Path(data).is_dir() else read_jsonl(data, cfg)


def write_jsonl(path: str | Path, prefs) -> bytes:
    """The pairs as JSONL (what ``read_jsonl`` reads); returns the bytes written."""
    lines = []
    for p in prefs:
        rec = {
            "prompt": p.prompt.decode(),
            "chosen": p.chosen.decode(),
            "rejected": p.rejected.decode(),
        }
        if not (p.chosen_stops and p.rejected_stops):
            rec.update(chosen_stops=p.chosen_stops, rejected_stops=p.rejected_stops)
        lines.append(json.dumps(rec))
    data = "".join(line + "\n" for line in lines).encode()
    Path(path).write_bytes(data)
    return data


def checked(p: Preferences) -> Preferences:
    if not p.train:
        raise TpulabError(f"no preference pair fits data.seq_len={p.params['seq_len']}")
    if not p.eval:
        raise TpulabError("the preference set has no evaluation pair")
    return p


def encode(prefs, seq_len: int) -> np.ndarray:
    """[N, 2, seq_len + 2] int32: (chosen, rejected) each as ``dialogue.encode`` lays a pair out;
    a reply that does not stop has its stop byte replaced by PAD (out of the mask)."""
    out = []
    for side in ("chosen", "rejected"):
        pairs = tuple(dialogue.Pair(p.prompt, getattr(p, side), p.source) for p in prefs)
        rows = dialogue.encode(pairs, seq_len)
        for i, p in enumerate(prefs):
            if not getattr(p, f"{side}_stops"):
                rows[i, 1 + len(dialogue.framed(pairs[i])) - 1] = PAD
        out.append(rows)
    return np.stack(out, axis=1)


def read_positions(mask_bt: np.ndarray) -> np.ndarray:
    """Per row, the input position holding the last response byte (the stop byte when it stops):
    target j is token j + 1, so it is ``last_response_index + 1``; 0 for a row with no mask."""
    return (last_response_index(mask_bt) + 1).astype(np.int32)


def to_batch(rows: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
    """[B, 2, S + 2] rows of pairs ``ids`` -> [2B] rows, chosen then rejected per pair:
    ``inputs``, ``targets``, ``mask`` [2B, S] (``dialogue.to_batch``), ``read`` [2B] (the reward
    model's position, ``read_positions``) and ``index`` [2B] = 2 * id + side (a row of a table
    kept per pair side, such as precomputed reference log-probs)."""
    b = rows.shape[0]
    out = dialogue.to_batch(rows.reshape(2 * b, rows.shape[-1]))
    out["read"] = read_positions(out["mask"])
    out["index"] = (2 * np.asarray(ids, np.int64)[:, None] + np.arange(2)).reshape(-1)
    out["index"] = out["index"].astype(np.int32)
    return out


def check_batch(batch: dict[str, np.ndarray]) -> None:
    """Each side's mask must cover a response in every live row (never nothing, never all), and
    the last response byte must be an input position (where a reward model reads)."""
    dialogue.check_batch(batch)
    live = batch["mask"].sum(axis=1) > 0
    if (batch["read"][live] >= batch["inputs"].shape[1]).any():
        raise TpulabError("a preference row's last response byte is past the inputs")


def train_dataset(
    rows: np.ndarray, cfg: DataConfig, process_index: int = 0, process_count: int = 1
):
    """Shuffled, repeated batches of ``cfg.batch_size`` pairs (``2 * batch_size`` rows), cut and
    split among processes as the SFT pairs are (``dialogue.train_dataset``)."""
    return dialogue.train_dataset(
        np.arange(len(rows)),
        cfg,
        process_index,
        process_count,
        batch_fn=lambda ids: to_batch(rows[ids], ids),
    )


def eval_batches(
    rows: np.ndarray, batch_size: int, max_batches: int, first_id: int = 0
) -> list[dict]:
    """The first ``max_batches`` batches of held-out pairs, in order; a short last batch is filled
    with PAD pairs (mask 0), so every pair counts once. Ids start at ``first_id``."""
    n = min(len(rows), batch_size * max_batches)
    ids = np.arange(first_id, first_id + n)
    rows = rows[:n]
    short = -n % batch_size
    if short:
        filler = np.full((short, *rows.shape[1:]), PAD, dtype=np.int32)
        filler[..., -1] = rows.shape[-1]  # a response start past the end: nothing in the mask
        rows = np.concatenate([rows, filler])
        ids = np.concatenate([ids, np.full(short, first_id, ids.dtype)])
    return [
        to_batch(rows[i : i + batch_size], ids[i : i + batch_size])
        for i in range(0, len(rows), batch_size)
    ]


def last_response_index(mask_bt: np.ndarray) -> np.ndarray:
    """Per row, the target index of the last byte in the loss mask (the stop byte): where a reward
    model reads its score. -1 for a row with nothing in its mask (padding)."""
    m = np.asarray(mask_bt) > 0
    last = m.shape[1] - 1 - np.argmax(m[:, ::-1], axis=1)
    return np.where(m.any(axis=1), last, -1)
