"""The promotion ledger: every registry action (register, promote, rollback, retire, delete) as one
JSON line beside the store, each carrying the sha256 of the line before it.

Why a file of our own: MLflow keeps no history of alias moves (mlflow/mlflow#2169, open since 2019),
and deleting the version that holds an alias silently drops the alias (measured with mlflow-skinny
3.17.2 on sqlite). The chain makes an edited, inserted or reordered entry detectable; the store's
``LEDGER_HEAD`` tag on each registered model (``tpulab.ops.tags``) names the model's newest entry,
so a removed tail or a replaced file is detected too. Who = ``$USER`` (else the uid's name), the
uid and the host; why = the user's ``--reason`` or a default naming the evidence.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pwd
import socket
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes
from tpulab.errors import TpulabError

LEDGER_NAME = "registry_ledger.jsonl"
GENESIS = "0" * 64  # the prev_sha256 of the first entry
ACTIONS = ("register", "promote", "rollback", "retire", "delete")


def canonical(obj) -> bytes:
    """The bytes an entry's sha256 covers: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def entry_sha256(entry: dict) -> str:
    return hashlib.sha256(canonical({k: v for k, v in entry.items() if k != "sha256"})).hexdigest()


def who() -> dict:
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no passwd entry (containers)
        name = None
    return {
        "user": os.environ.get("USER") or name or str(uid),
        "uid": uid,
        "host": socket.gethostname(),
    }


def read_ledger(path: str | Path) -> list[dict]:
    """Every entry, the chain checked: each line parses, its sha256 matches its content, its
    ``prev_sha256`` is the line before's and ``seq`` counts from 1. Raises TpulabError naming the
    first bad line; a missing file is an empty ledger (the store's LEDGER_HEAD says if it should
    exist)."""
    path = Path(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise TpulabError(f"ledger {path}: cannot read it ({e.strerror})") from None
    if lines and lines[-1] == b"":
        lines.pop()
    entries, prev = [], GENESIS
    for n, line in enumerate(lines, 1):
        where = f"ledger {path}, line {n}"
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            raise TpulabError(f"{where} is not a JSON object (edited or torn)") from None
        if entry.get("sha256") != entry_sha256(entry):
            raise TpulabError(f"{where}: the entry does not hash to its sha256 (it was edited)")
        if entry.get("prev_sha256") != prev:
            raise TpulabError(
                f"{where}: prev_sha256 does not match line {n - 1}'s sha256 "
                "(an entry was removed, inserted or reordered)"
            )
        if entry.get("seq") != n:
            raise TpulabError(f"{where}: seq {entry.get('seq')} where {n} belongs")
        entries.append(entry)
        prev = entry["sha256"]
    return entries


def make_entry(entries: list[dict], action: str, name: str, version: str, **fields) -> dict:
    """The next entry after ``entries``: chained, timestamped, signed by who ran it, hashed."""
    if action not in ACTIONS:
        raise ValueError(f"unknown ledger action {action!r}")
    entry = {
        "seq": len(entries) + 1,
        "prev_sha256": entries[-1]["sha256"] if entries else GENESIS,
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "who": who(),
        "action": action,
        "name": name,
        "version": str(version),
        **fields,
    }
    entry["sha256"] = entry_sha256(entry)
    return entry


def write_ledger(path: str | Path, entries: list[dict]) -> None:
    """The whole file, atomically (temp + fsync + rename): a crash leaves the old or the new
    ledger, never a torn line. Callers append to entries they just read and checked, under the
    store lock."""
    atomic_write_bytes(path, b"".join(canonical(e) + b"\n" for e in entries))


def model_entries(entries: list[dict], name: str) -> list[dict]:
    return [e for e in entries if e.get("name") == name]


def alias_stacks(entries: list[dict]) -> dict[str, list[str]]:
    """Per alias, the versions it was promoted to, oldest first, rollbacks popped: the top is the
    holder the ledger expects, the one below it is where a rollback goes (promote 1, 2, 3 then two
    rollbacks lands on 1, not back on 3)."""
    stacks: dict[str, list[str]] = {}
    for e in entries:
        alias = e.get("alias")
        if e["action"] == "promote":
            stacks.setdefault(alias, []).append(e["version"])
        elif e["action"] == "rollback":
            stack = stacks.setdefault(alias, [])
            if e["version"] not in stack:  # cannot happen through tpulab; keep the replay total
                stack[:] = [e["version"]]
            while stack[-1] != e["version"]:
                stack.pop()
    return stacks
