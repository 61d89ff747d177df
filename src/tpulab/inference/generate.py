"""Text generation over any Engine (jitted from a checkpoint, or exported endpoints): prefill once,
then one decode per new token, streaming UTF-8 text as it completes.

Sampling runs on the host in numpy from a seeded Generator: the logits are on the host anyway to
stream, and the same seed gives the same text on any backend that gives the same logits.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Iterator

import numpy as np

from tpulab.config import check, field
from tpulab.data.tokenizer import BOS, VOCAB_SIZE, encode
from tpulab.errors import TpulabError
from tpulab.inference.decode import Engine, pad_prompt


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new: int = field(64, "tokens to generate")
    temperature: float = field(0.8, "softmax temperature; 0 = greedy")
    top_k: int = field(0, "sample among the k most likely tokens; 0 = all")
    seed: int = field(0, "sampling seed: the same seed gives the same text")

    def __post_init__(self):
        check(self.max_new > 0, f"max_new={self.max_new} must be positive")
        check(0.0 <= self.temperature <= 10.0, f"temperature={self.temperature} must be in [0, 10]")
        check(0 <= self.top_k <= VOCAB_SIZE, f"top_k={self.top_k} must be in [0, {VOCAB_SIZE}]")
        check(0 <= self.seed < 2**63, f"seed={self.seed} must be a non-negative integer")


def sample(logits_v: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int) -> int:
    z = np.asarray(logits_v, np.float64)
    if temperature == 0.0:
        return int(np.argmax(z))
    z = z / temperature
    if 0 < top_k < z.size:
        z = np.where(z < np.partition(z, -top_k)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def prompt_ids(prompt: str, max_len: int, max_new: int) -> np.ndarray:
    """[BOS] + UTF-8 bytes, checked to leave room for ``max_new`` tokens in the cache."""
    ids = np.concatenate([[BOS], encode(prompt)]).astype(np.int32)
    if len(ids) + max_new > max_len:
        raise TpulabError(f"prompt ({len(ids) - 1} bytes + BOS) plus max_new={max_new} exceeds the model's "
                          f"{max_len} positions")
    return ids


def generate_ids(engine: Engine, prompt: str, cfg: SamplingConfig) -> Iterator[int]:
    """Yield ``cfg.max_new`` token ids continuing ``prompt``."""
    ids = prompt_ids(prompt, engine.max_len, cfg.max_new)
    batch = engine.batch
    logits_bv, cache = engine.prefill(pad_prompt(ids, engine.max_len, batch), np.int32(len(ids)))
    rng = np.random.default_rng(cfg.seed)
    pos = len(ids)
    for i in range(cfg.max_new):
        token = sample(np.asarray(logits_bv[0]), rng, cfg.temperature, cfg.top_k)
        yield token
        if i + 1 < cfg.max_new:
            logits_bv, cache = engine.decode(cache, np.full((batch,), token, np.int32), np.int32(pos))
            pos += 1


def generate_text(engine: Engine, prompt: str, cfg: SamplingConfig) -> Iterator[str]:
    """Stream text pieces; a multi-byte character is emitted once all its bytes have arrived."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in generate_ids(engine, prompt, cfg):
        piece = utf8.decode(bytes([token])) if token < 256 else ""
        if piece:
            yield piece
    tail = utf8.decode(b"", final=True)
    if tail:
        yield tail
