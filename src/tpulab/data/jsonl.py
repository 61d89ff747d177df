"""The one JSONL reader of the data layer: a user's file of records, one JSON object a line.

SFT pairs (``dialogue.from_jsonl``) and preference pairs (``preference.read_jsonl``, ``read_dir``)
read through it, so a bad line is refused the same way everywhere: one line naming ``file:line``.
Records are yielded one at a time, so a caller's own checks of line n run before line n + 1 is
parsed and the first bad line in the file is the one refused. A file's last items are held out for
evaluation the same way for both (``held_out``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

from tpulab.errors import TpulabError


def read_bytes(path: Path, what: str) -> bytes:
    """The file's bytes (their sha256 is part of a dataset's identity); ``what`` names the data."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise TpulabError(f"cannot read {what} {path}: {e.strerror}") from None


def records(path: Path, raw: bytes, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each non-blank line of ``raw`` (read from ``path``), ``where`` being
    ``file:line``; a line that is not UTF-8, not JSON, not an object, or lacks one of the string
    ``fields`` is refused with its ``where``."""
    quoted = [f"'{f}'" for f in fields]
    names = " and ".join(filter(None, (", ".join(quoted[:-1]), quoted[-1])))
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise TpulabError(f"{where}: not UTF-8 (byte 0x{line[e.start]:02x})") from None
        except ValueError as e:
            raise TpulabError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise TpulabError(f"{where}: expected an object with {names}")
        for key in fields:
            if not isinstance(rec.get(key), str):
                raise TpulabError(f"{where}: '{key}' is missing or not a string")
        yield where, rec


def held_out(path: Path, raw: bytes, items: list, seq_len: int, eval_fraction: float):
    """(train, eval, params) of a file's items: the last ``ceil(eval_fraction * n)`` (at least one)
    held out, at least two items in all; ``params`` names the file by its bytes' sha256."""
    if len(items) < 2:
        raise TpulabError(f"{path} holds {len(items)} usable pair(s); at least 2 are needed")
    n_eval = max(1, math.ceil(eval_fraction * len(items)))
    params = {"source": "jsonl", "file_sha256": hashlib.sha256(raw).hexdigest(), "seq_len": seq_len}
    return items[:-n_eval], items[-n_eval:], params
