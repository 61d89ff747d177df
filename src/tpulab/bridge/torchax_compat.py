"""Every torchax workaround tpulab needs, in one place, each applied only where its problem is.

torchax 0.0.13 with torch 2.13.0 has three problems this project hits:

1. ``import torchax`` raises AttributeError: torchax names ~22 named-tensor (Dimname) overloads such
   as ``aten.prod.dim_Dimname`` that torch 2.13 removed. They only appear as keys of lookup tables
   (autocast policies, decomposition lists), never as ops a program calls, so the fix is to let
   those lookups yield an inert placeholder *while torchax imports and builds its environment*:
   ``OpOverloadPacket.__getattr__`` is wrapped for that window only, and the names it stubbed are
   recorded. The plain import is tried first; the shim is used only when it fails that way.
2. torchax overrides ``torch.nn.functional.linear`` at the torch-function level with a jnp.einsum,
   which bypasses torch autograd: in eager mode ``loss.backward()`` finds no graph. Removing that
   one entry from the environment's op table lets F.linear fall through to aten.linear, which
   autograd decomposes into addmm/mm that torchax lowers. Only the eager method needs this; the
   jit method differentiates with jax.grad, where the override is harmless.
3. ``torch.save`` cannot serialize torchax tensors; state is copied to CPU torch tensors first
   (``to_cpu``).

tests/test_bridge_compat.py asserts that each raw problem still reproduces, so the suite fails
loudly the day an upstream release makes a workaround unnecessary.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch

APPLIED: list[str] = []  # names of the workarounds this process applied
STUBBED_OVERLOADS: list[str] = []  # overloads torch lacks that torchax asked for

_MISSING_OVERLOAD = "has no overload name"


class RemovedOverload:
    """Stands in for an overload torch removed; hashable, equal only to itself, never callable."""

    def __init__(self, qualified_name: str):
        self.qualified_name = qualified_name

    def __repr__(self) -> str:
        return f"<overload {self.qualified_name} removed from torch {torch.__version__}>"


@contextlib.contextmanager
def _tolerate_removed_overloads():
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_or_placeholder(self, key):
        try:
            return original(self, key)
        except AttributeError as e:
            if key.startswith("__") or _MISSING_OVERLOAD not in str(e):
                raise
            name = f"{self._qualified_op_name}.{key}"
            STUBBED_OVERLOADS.append(name)
            return RemovedOverload(name)

    packet.__getattr__ = getattr_or_placeholder
    try:
        yield
    finally:
        packet.__getattr__ = original


def import_torchax():
    """``import torchax`` and build its default environment; the overload shim only if needed."""
    if "torchax" in sys.modules and "named-overload-shim" not in APPLIED:
        import torchax

        return torchax
    try:
        torchax = importlib.import_module("torchax")
        torchax.default_env()
        return torchax
    except AttributeError as e:
        if _MISSING_OVERLOAD not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
        del sys.modules[name]
    with _tolerate_removed_overloads():
        torchax = importlib.import_module("torchax")
        torchax.default_env()  # loads the decomposition tables, which name removed overloads too
    APPLIED.append("named-overload-shim")
    return torchax


def enable_eager_autograd(env) -> None:
    """Let F.linear reach aten (and so autograd) in ``env``, if torchax still overrides it there."""
    if torch.nn.functional.linear in env._ops:
        del env._ops[torch.nn.functional.linear]
        APPLIED.append("eager-linear-autograd")


def to_cpu(tree):
    """A copy of ``tree`` with every tensor (torchax or not) a CPU torch tensor, for torch.save."""
    import contextlib

    from torch.utils import _pytree as pytree

    # torchax tensors only move (or do anything) inside the torchax environment
    ctx = (
        sys.modules["torchax"].default_env()
        if "torchax" in sys.modules
        else contextlib.nullcontext()
    )
    with ctx:
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu"), tree)
