"""The bridge capstone: a small torch MLP trained on torch, torchax (eager and jit) or torch_xla,
checkpointed in full, killed, resumed, proven bitwise identical, and compared across runtimes.

Public names are imported lazily (PEP 562), so importing this stays cheap: torch, jax and torchax
load only with the module that needs them.
"""

from __future__ import annotations

from tpulab.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
