"""Byte-level tokenizer: ids 0-255 are raw bytes, then two special tokens.

BOS (256) starts every document, so a model sees where a work begins; PAD (257) fills the tail of
a document's last window and is never a target (its mask is 0). The definition is recorded in
checkpoints and export manifests so a mismatched tokenizer is caught, not silently used.
"""

from __future__ import annotations

import numpy as np

BOS = 256
PAD = 257
VOCAB_SIZE = 258

DEFINITION = {"kind": "bytes", "bytes": 256, "bos": BOS, "pad": PAD, "vocab_size": VOCAB_SIZE}


def encode(text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids) -> str:
    """Bytes only: special tokens are dropped; invalid UTF-8 is replaced, never raised."""
    arr = np.asarray(ids).reshape(-1)
    return bytes(int(i) for i in arr if 0 <= int(i) < 256).decode("utf-8", errors="replace")
