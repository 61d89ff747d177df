"""A built dataset with held-out items: what SFT pairs, preference pairs and PPO's prompts share.

Each is training and evaluation items, the builder's parameters and an identity that hashes the
builder's version, those parameters and every item's bytes; its description (documents.json) is
the same record, with counts named after what an item is and the set's own facts after them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class HeldOutSet:
    train: Any  # the training items
    eval: Any  # the held-out items
    params: dict  # the builder's parameters (part of the identity)
    identity: str

    builder = "?"  # the builder's name and version
    unit = "items"  # what an item is called in the description: pairs, prompts

    def describe(self) -> dict:
        return {
            "builder": self.builder,
            **self.params,
            "identity": self.identity,
            f"train_{self.unit}": len(self.train),
            f"eval_{self.unit}": len(self.eval),
            **self.facts(),
        }

    def facts(self) -> dict:
        """The set's own entries in its description, after the shared ones."""
        return {}


def identity_hash(builder: str, params: dict):
    """A sha256 over the builder and its parameters, to which the caller adds every item."""
    return hashlib.sha256(json.dumps({"builder": builder, **params}, sort_keys=True).encode())


def hash_fields(h, fields: Iterable[bytes]) -> None:
    """Each field into ``h`` after its length (8 bytes, little-endian): the boundaries count."""
    for field_bytes in fields:
        h.update(len(field_bytes).to_bytes(8, "little"))
        h.update(field_bytes)
