"""Exported endpoints, generation front ends and serving, on the model layer's KV-cache decode.

Public names are imported lazily so ``import tpulab.inference`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "generate_text": "generate",
    "generate_batch": "generate",
    "Request": "generate",
    "KVEvalConfig": "cache_eval",
    "write_kvcache_report": "cache_eval",
    "export_artifacts": "export",
    "open_artifacts": "artifacts",
    "verify_export": "trust",
    "load_verified": "trust",
    "decode_speed": "speed",
    "capstone_stage": "capstone",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tpulab.inference.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tpulab.inference' has no attribute {name!r}")
