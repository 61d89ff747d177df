"""Exported endpoints, generation front ends and serving, on the model layer's KV-cache decode.

Public names are imported lazily so ``import tpulab.inference`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib

# name -> "module:attribute"
_EXPORTS = {
    "generate_text": "tpulab.inference.generate:generate_text",
    "generate_batch": "tpulab.inference.generate:generate_batch",
    "Request": "tpulab.inference.generate:Request",
    "KVEvalConfig": "tpulab.inference.cache_eval:KVEvalConfig",
    "write_kvcache_report": "tpulab.inference.cache_eval:write_kvcache_report",
    "export_artifacts": "tpulab.inference.export:export_artifacts",
    "open_artifacts": "tpulab.inference.artifacts:open_artifacts",
    "verify_export": "tpulab.inference.trust:verify_export",
    "load_verified": "tpulab.inference.trust:load_verified",
    "decode_speed": "tpulab.inference.speed:decode_speed",
    "capstone_stage": "tpulab.inference.capstone:capstone_stage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = _EXPORTS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
