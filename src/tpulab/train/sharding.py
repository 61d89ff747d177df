"""Where every array of the training state lives on the device mesh: one readable table.

The mesh has two axes, ``data`` and ``fsdp``. The batch is split over both (every device sees its
own rows); parameters and both Adam moments are split over ``fsdp`` on one dimension (each large
matrix), small vectors and scalars are replicated. With ``fsdp: 1`` this is plain data parallelism
(replicated state, gradients all-reduced); with ``fsdp > 1`` XLA's partitioner all-gathers a matrix
where the forward and backward pass need it and reduce-scatters its gradient into the shard that
owns it. The default ``{data: 0 (all devices), fsdp: 1}`` on one CPU is the same code: a 1x1 mesh.

Rules match the leaf's path (``blocks/0/attn/qkv/kernel``; Adam's ``mu``/``nu`` paths end in the
same parameter path, so a moment always lives where its parameter lives). First match wins. A
dimension that ``fsdp`` does not divide is replicated instead and reported by ``layout_table``
(never silently uneven).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab.errors import ConfigError
from tpulab.train.config import MeshConfig

DATA_AXIS, FSDP_AXIS = "data", "fsdp"
AXES = (DATA_AXIS, FSDP_AXIS)
BATCH_SPEC = P((DATA_AXIS, FSDP_AXIS))  # rows of the global batch over every device, process-major

# (pattern on the leaf path, PartitionSpec). Matrices split on their first (input/vocab) dimension.
RULES: tuple[tuple[str, P], ...] = (
    (r"embed/embedding$", P(FSDP_AXIS, None)),  # [vocab, d_model]: vocabulary rows
    (r"attn/qkv/kernel$", P(FSDP_AXIS, None)),  # [d_model, 3 d_model]
    (r"attn/out/kernel$", P(FSDP_AXIS, None)),  # [d_model, d_model]
    (r"mlp/up/kernel$", P(FSDP_AXIS, None)),  # [d_model, d_ff]
    (r"mlp/down/kernel$", P(FSDP_AXIS, None)),  # [d_ff, d_model]
    (r".*", P()),  # norm scales, step, Adam count, dropout key: replicated
)


def leaf_path(path) -> str:
    """``blocks/0/attn/qkv/kernel`` from a jax key path (nnx's trailing ``value`` dropped)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def resolve(cfg: MeshConfig, n_devices: int) -> tuple[int, int]:
    """(data, fsdp) for ``n_devices`` devices; a one-line error when they do not multiply to it."""
    if n_devices % cfg.fsdp:
        raise ConfigError(f"mesh.fsdp={cfg.fsdp} does not divide the {n_devices} devices JAX sees")
    data = cfg.data or n_devices // cfg.fsdp
    if data * cfg.fsdp != n_devices:
        raise ConfigError(
            f"mesh data={data} x fsdp={cfg.fsdp} = {data * cfg.fsdp} devices, but JAX sees "
            f"{n_devices} (the mesh must use every device exactly once)"
        )
    return data, cfg.fsdp


def make_mesh(cfg: MeshConfig | None = None, devices: list | None = None) -> Mesh:
    """A (data, fsdp) mesh over all devices, ordered by process then id.

    Each process then owns a contiguous block of batch rows (what
    ``make_array_from_process_local_data`` expects).
    """
    devices = sorted(devices or jax.devices(), key=lambda d: (d.process_index, d.id))
    data, fsdp = resolve(cfg or MeshConfig(), len(devices))
    return Mesh(np.array(devices, dtype=object).reshape(data, fsdp), AXES)


def check_batch(batch_size: int, mesh: Mesh) -> None:
    n = mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]
    if batch_size % n:
        raise ConfigError(
            f"data.batch_size={batch_size} is not divisible by the data-parallel size {n} "
            f"(mesh data={mesh.shape[DATA_AXIS]} x fsdp={mesh.shape[FSDP_AXIS]})"
        )


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh) -> tuple[P, str]:
    """(PartitionSpec, the rule's pattern) for one leaf.

    A split dimension that fsdp does not divide is replicated.
    """
    for pattern, spec in RULES:
        if re.search(pattern, path):
            if len(spec) > len(shape):
                return P(), pattern + " (rank too small: replicated)"
            for dim, axis in zip(shape, spec):
                if axis is not None and dim % mesh.shape[axis]:
                    return (
                        P(),
                        pattern
                        + f" ({dim} not divisible by {axis}={mesh.shape[axis]}: replicated)",
                    )
            return spec, pattern
    return P(), "(no rule)"


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every leaf of ``abstract_state`` (same tree structure)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    return jax.tree_util.tree_unflatten(
        treedef,
        [NamedSharding(mesh, spec_for(leaf_path(p), tuple(x.shape), mesh)[0]) for p, x in flat],
    )


def placed_shapes(shapes: Any, mesh: Mesh, shardings: Any = None) -> Any:
    """``shapes`` (``jax.eval_shape`` of a state) with each leaf's sharding from this table (or
    ``shardings``, when already computed): a restore target, nothing computed or read."""
    shardings = state_shardings(shapes, mesh) if shardings is None else shardings
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def layout_table(abstract_state: Any, mesh: Mesh) -> list[dict]:
    """One row per leaf: path, shape, PartitionSpec, per-device shape, the rule that decided it."""
    rows = []
    for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        path = leaf_path(p)
        spec, rule = spec_for(path, tuple(x.shape), mesh)
        local = NamedSharding(mesh, spec).shard_shape(tuple(x.shape))
        rows.append(
            {
                "path": path,
                "shape": list(x.shape),
                "spec": str(spec),
                "per_device": list(local),
                "rule": rule,
            }
        )
    return rows


def topology(mesh: Mesh) -> dict:
    """What a checkpoint records about where it was written.

    A resume elsewhere needs ``tpulab reshard``.
    """
    return {
        "mesh": {DATA_AXIS: int(mesh.shape[DATA_AXIS]), FSDP_AXIS: int(mesh.shape[FSDP_AXIS])},
        "process_count": jax.process_count(),
        "device_count": int(mesh.devices.size),
    }
