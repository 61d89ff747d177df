"""The ledger against the store: checked before every registry command, written with every change.

``consistent_ledger`` refuses a broken chain, or a ledger that does not end where the store's
``LEDGER_HEAD`` tag says; ``unchanged_since`` re-checks, under the lock, what a command saw
before it verified unlocked; ``drift`` names aliases moved outside tpulab; ``transact`` appends an
entry, moves the head and applies the store change, or puts all three back.
"""

from __future__ import annotations

import contextlib
import sys

from tpulab.errors import TpulabError
from tpulab.ops import ledger
from tpulab.ops import tags as T
from tpulab.ops.registry_store import (
    Registry,
    aliases_of,
    model_version,
    registered_model,
    store_call,
    store_errors,
)


def consistent_ledger(reg: Registry, name: str) -> tuple[list[dict], list[dict], object]:
    """(all entries, this model's entries, the registered model or None), after checking the chain
    and that the ledger ends where the store's LEDGER_HEAD tag says."""
    entries = ledger.read_ledger(reg.ledger_path)
    mine = ledger.model_entries(entries, name)
    model = registered_model(reg, name)
    head = model.tags.get(T.LEDGER_HEAD) if model is not None else None
    newest = mine[-1]["sha256"] if mine else None
    if model is None and mine:
        raise TpulabError(
            f"ledger {reg.ledger_path} holds {len(mine)} entries for {name} but the store has no "
            "such model (deleted outside tpulab?); use another name"
        )
    if head != newest:
        raise TpulabError(
            f"ledger {reg.ledger_path} does not end where the store says: {name}'s newest entry "
            f"should be {(head or 'none')[:12]}, the ledger's is {(newest or 'none')[:12]} "
            "(entries removed, or the ledger replaced)"
        )
    return entries, mine, model


def unchanged_since(reg: Registry, name: str, entries: list[dict], model, mv=None) -> None:
    """Under the lock, before a commit: the ledger, the model's aliases and the version's tags are
    what the command checked before its verification ran unlocked; else refuse."""
    now, _, model_now = consistent_ledger(reg, name)
    same = [e["sha256"] for e in now] == [e["sha256"] for e in entries]
    same = same and aliases_of(model_now) == aliases_of(model)
    if mv is not None:
        mv_now = model_version(reg, name, mv.version, required=False)
        same = same and mv_now is not None and mv_now.tags == mv.tags
    if not same:
        raise TpulabError(
            f"the registry entry of {name} changed while this command verified it (another command "
            "ran meanwhile); nothing was changed: run it again"
        )


def drift(mine: list[dict], model) -> list[str]:
    """Where the store's aliases differ from the ledger's replay: moves made outside tpulab."""
    expected = {a: s[-1] for a, s in ledger.alias_stacks(mine).items() if s}
    actual = aliases_of(model)
    out = []
    for alias in sorted(set(expected) | set(actual)):
        want, got = expected.get(alias), actual.get(alias)
        if want != got:
            out.append(
                f"alias {alias} is on {'v' + got if got else 'no version'} in the store, the "
                f"ledger's last move put it on {'v' + want if want else 'no version'} "
                "(moved, or its version deleted, outside tpulab)"
            )
    return out


def transact(reg, name, entries, entry, apply=lambda: None, undo=lambda: None) -> None:
    """Append ``entry``, point the model's LEDGER_HEAD at it, then ``apply`` the store change; on
    any failure put the ledger and the head back and ``undo``."""
    c, had_file = reg.client, reg.ledger_path.exists()
    mine = ledger.model_entries(entries, name)
    old_head = mine[-1]["sha256"] if mine else None
    try:
        with store_call(reg, f"recording {entry['action']} of {name} v{entry['version']}"):
            ledger.write_ledger(reg.ledger_path, [*entries, entry])
            c.set_registered_model_tag(name, T.LEDGER_HEAD, entry["sha256"])
            apply()
    except BaseException:
        # Best effort: if putting things back fails too, the next command sees the mismatch
        # (LEDGER_HEAD or drift) and says so; the first error is the one reported.
        with contextlib.suppress(*store_errors()):
            if entries or had_file:
                ledger.write_ledger(reg.ledger_path, entries)
            else:
                reg.ledger_path.unlink(missing_ok=True)
            if old_head is None:
                c.delete_registered_model_tag(name, T.LEDGER_HEAD)
            else:
                c.set_registered_model_tag(name, T.LEDGER_HEAD, old_head)
            undo()
        raise


def warn(messages: list[str]) -> list[str]:
    for m in messages:
        print(f"warning: {m}", file=sys.stderr)
    return messages
