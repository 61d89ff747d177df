"""Lazy package faces (PEP 562): a package's public names, imported when first used.

``tpulab``, ``tpulab.bridge`` and ``tpulab.inference`` export this way, so importing a package stays
cheap (no jax, torch or torchax until a name that needs them is read).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(
    module_globals: dict, exports: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``(__getattr__, __dir__)`` of a package whose ``exports`` map name ->
    "module:attribute"; assign both at module level."""
    package = module_globals["__name__"]

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = exports[name].partition(":")
        return getattr(importlib.import_module(module), attribute)

    def __dir__() -> list[str]:
        return sorted({*module_globals, *exports})

    return __getattr__, __dir__
