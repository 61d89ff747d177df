"""The bridge capstone: a small torch MLP trained on torch, torchax (eager and jit) or torch_xla,
checkpointed in full, killed, resumed, proven bitwise identical, and compared across runtimes.

Heavy imports (torch, jax, torchax) happen inside the functions, so importing this stays cheap.
"""

from __future__ import annotations

from tpulab.bridge.config import BACKENDS, METHODS, BridgeConfig, check_backend_method

__all__ = [
    "BACKENDS",
    "METHODS",
    "BridgeConfig",
    "check_backend_method",
    "train",
    "prove",
    "compare",
    "capstone_stage",
]


def train(*args, **kwargs):
    from tpulab.bridge.loop import train as _train

    return _train(*args, **kwargs)


def prove(*args, **kwargs):
    from tpulab.bridge.prove import prove as _prove

    return _prove(*args, **kwargs)


def compare(*args, **kwargs):
    from tpulab.bridge.compare import compare as _compare

    return _compare(*args, **kwargs)


def capstone_stage(out_dir):
    from tpulab.bridge.capstone import capstone_stage as _stage

    return _stage(out_dir)
