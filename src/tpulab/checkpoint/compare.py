"""Two state pytrees compared truly bitwise: dtype, shape and bytes of every leaf (NaN == NaN,
-0.0 != 0.0). Used by the whole-state verdicts of the proofs (the Transformer's TrainState, the
bridge's torch state dicts) and by reshard's checks that a restore onto another layout, and the
resharded checkpoint read back, changed no bit."""

from __future__ import annotations

import jax
import numpy as np


def _bits(x) -> tuple:
    a = np.asarray(x)
    return a.dtype.str, a.shape, a.tobytes()  # bytes, so NaN == NaN and -0.0 != 0.0: truly bitwise


def compare_trees(a, b) -> tuple[int, str | None]:
    """(leaves compared, keystr path of the first leaf whose dtype, shape or bytes differ). A
    structural difference is named by the first leaf path only one side has."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    if ta != tb:
        pa = [jax.tree_util.keystr(p) for p, _ in la]
        pb = [jax.tree_util.keystr(p) for p, _ in lb]
        only = next((x for x, y in zip(pa, pb) if x != y), None)
        only = only or (pa[len(pb)] if len(pa) > len(pb) else pb[len(pa)] if pb != pa else "")
        return 0, f"<tree structure> at {only or 'the root'}"
    for (path, x), (_, y) in zip(la, lb):
        if _bits(x) != _bits(y):
            return len(la), jax.tree_util.keystr(path)
    return len(la), None
