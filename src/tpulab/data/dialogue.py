"""Prompt/response pairs for supervised fine-tuning: cut from the plays, or read from a JSONL file.

Built-in pairs come from the corpus's own plays. A play is a sequence of paragraphs; a speech is a
paragraph whose first line is a speaker's name ending in a full stop (``Ham.``, ``First Clown.``),
a paragraph in brackets is a stage direction (dropped), ``ACT ...`` and ``Scene ...`` headings end a
scene, and any other paragraph continues the speech before it (a speech resumed after a direction).
Each pair is a cue speech and the next speech of the same scene by another speaker:

    prompt   = "<cue speaker>.\\n<cue text>\\n\\n<responder>.\\n"
    response = "<response text>"

framed in the model's byte stream as ``BOS SOH prompt STX response ETX``: SOH (0x01) opens the
prompt, STX (0x02) opens the response, ETX (0x03) is the stop byte. The shipped corpus holds no byte
below 0x20 but tab, newline and carriage return (checked when the pairs are built), so these bytes
cannot occur in the text; data holding them is refused. The loss mask covers the response and the
stop byte, nothing else: a model trained on it learns to answer and to stop.

A pair must fit the model's context (``seq_len + 1`` tokens with BOS): the cue text is cut from the
left (it keeps its last bytes, from a word boundary), keeping at least ``MIN_CUE_BYTES`` of it; a
pair whose response does not fit beside that is left out (at the tiny test size, 32 positions,
this keeps the short replies). The split is by play: the plays held out are exactly the pretraining
split's validation documents, so evaluation never measures memorisation of a seen play. The
dataset's identity hashes the builder's version, its parameters and every pair's bytes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import grain
import numpy as np

from tpulab.data import jsonl
from tpulab.data.config import DataConfig
from tpulab.data.corpus import Corpus, Document
from tpulab.data.heldout import HeldOutSet, hash_fields, identity_hash
from tpulab.data.pipeline import READ_OPTIONS, process_batches, split_documents
from tpulab.data.tokenizer import BOS, PAD
from tpulab.errors import TpulabError

PROMPT_START, RESPONSE_START, STOP = 0x01, 0x02, 0x03
DELIMITERS = bytes([PROMPT_START, RESPONSE_START, STOP])
BUILDER = "tpulab-dialogue-v1"
MIN_CUE_BYTES = 8  # a prompt keeps at least this much of its cue speech

_SPEAKER = re.compile(rb"^[A-Z][A-Za-z'\- ]{0,38}\.$")
_HEADING = re.compile(rb"^(ACT|Act|SCENE|Scene)\b")
_DIRECTION = re.compile(rb"\[[^\]]*\]")
_PARAGRAPHS = re.compile(rb"\n[ \t\r]*\n")


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: bytes
    response: bytes
    source: str  # the play (or file:line) it came from


@dataclasses.dataclass(frozen=True)
class Speech:
    speaker: bytes
    text: bytes


def scenes(doc: Document) -> list[list[Speech]]:
    """The play's speeches, scene by scene (stage directions dropped)."""
    out: list[list[Speech]] = [[]]
    for para in _PARAGRAPHS.split(doc.data.replace(b"\r\n", b"\n")):
        para = para.strip(b"\n")
        if not para.strip():
            continue
        lines = para.split(b"\n")
        if _HEADING.match(lines[0]):
            out.append([])
            continue
        text = _DIRECTION.sub(b"", b"\n".join(lines[1:]) if _SPEAKER.match(lines[0]) else para)
        text = b"\n".join(line.strip() for line in text.split(b"\n") if line.strip())
        if _SPEAKER.match(lines[0]) and len(lines) > 1:
            if text:
                out[-1].append(Speech(lines[0][:-1], text))
        elif text and out[-1] and not para.lstrip().startswith(b"["):
            last = out[-1][-1]  # a speech resumed after a stage direction
            out[-1][-1] = Speech(last.speaker, last.text + b"\n" + text)
    return [s for s in out if s]


def play_pairs(doc: Document) -> list[Pair]:
    pairs = []
    for scene in scenes(doc):
        for cue, reply in zip(scene, scene[1:]):
            if cue.speaker != reply.speaker:
                prompt = cue.speaker + b".\n" + cue.text + b"\n\n" + reply.speaker + b".\n"
                pairs.append(Pair(prompt, reply.text, doc.name))
    return pairs


def fit(pair: Pair, seq_len: int) -> Pair | None:
    """The pair cut to ``seq_len + 1`` framed tokens, or None when the response does not fit.

    Only a built-in pair's cue text is cut (from the left, from a word boundary); its speaker
    names and the response stay whole.
    """
    budget = seq_len - len(framed(pair))  # seq_len + 1 tokens, one of them BOS
    if budget >= 0:
        return pair
    head, rest = pair.prompt.split(b"\n", 1)
    cue, tail = rest.rsplit(b"\n\n", 1)
    keep = len(cue) + budget
    if keep < MIN_CUE_BYTES:
        return None
    cut = cue[len(cue) - keep :]
    space = re.search(rb"\s", cut)
    if space is not None and len(cut) - space.end() >= MIN_CUE_BYTES:
        cut = cut[space.end() :]
    return Pair(head + b"\n" + cut + b"\n\n" + tail, pair.response, pair.source)


def framed(pair: Pair) -> bytes:
    """The pair as the model reads it after BOS: SOH prompt STX response ETX."""
    return (
        bytes([PROMPT_START])
        + pair.prompt
        + bytes([RESPONSE_START])
        + pair.response
        + bytes([STOP])
    )


def check_no_delimiters(corpus: Corpus) -> None:
    for doc in corpus.documents:
        bad = set(doc.data) & set(DELIMITERS)
        if bad:
            raise TpulabError(
                f"{corpus.source}: document {doc.name} holds byte 0x{min(bad):02x}, which the "
                "dialogue format uses as a delimiter (SOH/STX/ETX); refusing to build pairs"
            )


class Dialogue(HeldOutSet):
    """The fitted train and evaluation pairs (tuples of ``Pair``), and what they are."""

    builder, unit = BUILDER, "pairs"

    def facts(self) -> dict:
        return {
            "train_sources": sorted({p.source for p in self.train}),
            "eval_sources": sorted({p.source for p in self.eval}),
        }


def identity_of(params: dict, train: list[Pair], evals: list[Pair]) -> str:
    h = identity_hash(BUILDER, params)
    for part, pairs in (("train", train), ("eval", evals)):
        h.update(part.encode())
        for p in pairs:
            hash_fields(h, (p.prompt, p.response))
    return h.hexdigest()


def from_plays(corpus: Corpus, cfg: DataConfig) -> Dialogue:
    """Pairs from the corpus's plays; evaluation pairs from the pretraining validation plays."""
    check_no_delimiters(corpus)
    train_docs, val_docs = split_documents(corpus, cfg)

    def build(docs) -> list[Pair]:
        fitted = (fit(p, cfg.seq_len) for d in docs for p in play_pairs(d))
        return [p for p in fitted if p is not None]

    train, evals = build(train_docs), build(val_docs)
    params = {
        "source": "plays",
        "corpus_identity": corpus.identity,
        "seq_len": cfg.seq_len,
        "split_seed": cfg.split_seed,
        "val_fraction": cfg.val_fraction,
        "min_cue_bytes": MIN_CUE_BYTES,
    }
    return checked(Dialogue(tuple(train), tuple(evals), params, identity_of(params, train, evals)))


def from_jsonl(path: str | Path, cfg: DataConfig, eval_fraction: float = 0.1) -> Dialogue:
    """``{"prompt": str, "response": str}`` per line; every bad line is refused with its number.

    The last ``ceil(eval_fraction * n)`` pairs (at least one) are held out for evaluation.
    """
    path = Path(path)
    raw = jsonl.read_bytes(path, "SFT data")
    pairs = []
    for where, rec in jsonl.records(path, raw, ("prompt", "response")):
        pair = Pair(rec["prompt"].encode(), rec["response"].encode(), where)
        if not pair.response:
            raise TpulabError(f"{where}: the response is empty (nothing to learn)")
        bad = set(pair.prompt + pair.response) & set(DELIMITERS)
        if bad:
            raise TpulabError(
                f"{where}: holds byte 0x{min(bad):02x}, a delimiter of the dialogue format"
            )
        if 1 + len(framed(pair)) > cfg.seq_len + 1:
            raise TpulabError(
                f"{where}: prompt and response take {1 + len(framed(pair))} tokens framed, "
                f"longer than the context (data.seq_len + 1 = {cfg.seq_len + 1})"
            )
        pairs.append(pair)
    train, evals, params = jsonl.held_out(path, raw, pairs, cfg.seq_len, eval_fraction)
    return checked(Dialogue(tuple(train), tuple(evals), params, identity_of(params, train, evals)))


def checked(d: Dialogue) -> Dialogue:
    if not d.train:
        raise TpulabError(
            f"the dialogue set has no training pair that fits data.seq_len={d.params['seq_len']}"
        )
    if not d.eval:
        raise TpulabError("the dialogue set has no evaluation pair (the held-out plays gave none)")
    return d


def encode(pairs: tuple[Pair, ...], seq_len: int) -> np.ndarray:
    """[N, seq_len + 2] int32: the framed tokens (PAD-filled) and, last, where the response starts.

    One array, so a Grain source indexes rows and the response starts travel with them.
    """
    out = np.full((len(pairs), seq_len + 2), PAD, dtype=np.int32)
    for i, p in enumerate(pairs):
        tokens = np.frombuffer(framed(p), dtype=np.uint8)
        if len(tokens) > seq_len:
            raise TpulabError(
                f"pair from {p.source} takes {len(tokens) + 1} tokens framed, more "
                f"than seq_len + 1 = {seq_len + 1}"
            )
        out[i, 0] = BOS
        out[i, 1 : 1 + len(tokens)] = tokens
        out[i, -1] = 2 + len(p.prompt) + 1  # BOS, SOH, prompt, STX: the response's first index
    return out


def to_batch(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Encoded rows -> inputs, targets [B, S] and the response-only mask [B, S] float32.

    Target j is token j + 1; it is in the loss when it is a response byte or the stop byte: at
    index >= the response start, and not PAD.
    """
    tokens, start = rows[:, :-1], rows[:, -1:]
    targets = tokens[:, 1:]
    index = np.arange(1, tokens.shape[1])[None, :]
    mask = (index >= start) & (targets != PAD)
    return {"inputs": tokens[:, :-1], "targets": targets, "mask": mask.astype(np.float32)}


def check_batch(batch: dict[str, np.ndarray]) -> None:
    """A batch whose loss mask trains on nothing or on everything is an error, never a warning."""
    mask = batch["mask"]
    live = mask.sum(axis=1)
    if not live.any():
        raise TpulabError("SFT batch has an all-zero loss mask: it would train on nothing")
    if (mask > 0).all():
        raise TpulabError("SFT batch has an all-ones loss mask: it would train on the prompts too")
    empty = np.flatnonzero((live == 0) & (batch["inputs"][:, 0] != PAD))
    if empty.size:
        raise TpulabError(f"SFT batch row {int(empty[0])} has no response byte in its loss mask")


def train_dataset(
    rows: np.ndarray,
    cfg: DataConfig,
    process_index: int = 0,
    process_count: int = 1,
    batch_fn=to_batch,
) -> grain.IterDataset:
    """Shuffled (reshuffled each epoch), repeated batches of pairs; each process its own rows
    (``tpulab.data.pipeline.process_batches``, as windows are cut).
    ``batch_fn`` turns a batch of rows into arrays (preference pairs bring their own)."""
    ds = process_batches(rows, cfg, process_index, process_count)
    return ds.map(batch_fn).to_iter_dataset(READ_OPTIONS)


def eval_batches(rows: np.ndarray, batch_size: int, max_batches: int) -> list[dict]:
    """The first ``max_batches`` batches of held-out pairs, in order; a short last batch is filled
    with PAD rows whose mask is 0, so every pair counts exactly once."""
    n = min(len(rows), batch_size * max_batches)
    rows = rows[:n]
    short = -n % batch_size
    if short:
        filler = np.full((short, rows.shape[1]), PAD, dtype=np.int32)
        filler[:, -1] = rows.shape[1]  # a response start past the end: nothing in the mask
        rows = np.concatenate([rows, filler])
    return [to_batch(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
