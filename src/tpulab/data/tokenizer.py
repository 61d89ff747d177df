"""Byte-level tokenizer: ids 0-255 are raw bytes, then two special tokens.

BOS (256) starts every document, so a model sees where a work begins; PAD (257) fills the tail of
a document's last window and is never a target (its mask is 0). The definition is recorded in
checkpoints and export manifests so a mismatched tokenizer is caught, not silently used.

Masked-byte training (objective ``mlm``) adds a third special, MASK (258), after the two: its runs
set ``model.vocab_size: 259`` and record ``MASKED_DEFINITION``. Nothing else changes: the other
objectives' vocabulary, definition and bits stay the 258 ids above.
"""

from __future__ import annotations

import numpy as np

BOS = 256
PAD = 257
VOCAB_SIZE = 258

DEFINITION = {"kind": "bytes", "bytes": 256, "bos": BOS, "pad": PAD, "vocab_size": VOCAB_SIZE}
MASK = 258  # what a masked-byte input shows at a hidden position
MASKED_VOCAB_SIZE = 259
MASKED_DEFINITION = {**DEFINITION, "mask": MASK, "vocab_size": MASKED_VOCAB_SIZE}


def encode(text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids) -> str:
    """Bytes only: special tokens are dropped; invalid UTF-8 is replaced, never raised."""
    arr = np.asarray(ids).reshape(-1)
    return bytes(int(i) for i in arr if 0 <= int(i) < 256).decode("utf-8", errors="replace")
