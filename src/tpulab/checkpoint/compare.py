"""Two state pytrees compared truly bitwise: dtype, shape and bytes of every leaf (NaN == NaN, -0.0 != 0.0).
Used by the whole-state verdicts of the proofs and by reshard's check that a restore onto another layout
changed no bit."""

from __future__ import annotations

import jax
import numpy as np


def _bits(x) -> tuple:
    a = np.asarray(x)
    return a.dtype.str, a.shape, a.tobytes()  # bytes, so NaN == NaN and -0.0 != 0.0: truly bitwise


def compare_trees(a, b) -> tuple[int, str | None]:
    """(leaves compared, keystr path of the first leaf whose dtype, shape or bytes differ)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    if ta != tb:
        return 0, "<tree structure>"
    for (path, x), (_, y) in zip(la, lb):
        if _bits(x) != _bits(y):
            return len(la), jax.tree_util.keystr(path)
    return len(la), None
