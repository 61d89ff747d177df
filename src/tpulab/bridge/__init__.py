"""The bridge capstone: a small torch MLP trained on torch, torchax (eager and jit) or torch_xla,
checkpointed in full, killed, resumed, proven bitwise identical, and compared across runtimes.

Public names are imported lazily (PEP 562), so importing this stays cheap: torch, jax and torchax
load only with the module that needs them.
"""

from __future__ import annotations

import importlib

# name -> "module:attribute". The kill/resume proof and the comparison are exported as
# ``prove_resume`` and ``compare_backends``, not as ``prove`` and ``compare``: those are also the
# submodules' names, and importing a submodule rebinds its parent's attribute to the module.
_EXPORTS = {
    "BACKENDS": "tpulab.bridge.config:BACKENDS",
    "METHODS": "tpulab.bridge.config:METHODS",
    "BridgeConfig": "tpulab.bridge.config:BridgeConfig",
    "check_backend_method": "tpulab.bridge.config:check_backend_method",
    "train": "tpulab.bridge.loop:train",
    "prove_resume": "tpulab.bridge.prove:prove",
    "compare_backends": "tpulab.bridge.compare:compare",
    "capstone_stage": "tpulab.bridge.capstone:capstone_stage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = _EXPORTS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
