"""Exported endpoints, generation front ends and serving, on the model layer's KV-cache decode.

Public names are imported lazily so ``import tpulab.inference`` stays cheap for the CLI.
"""

from __future__ import annotations

from tpulab.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
