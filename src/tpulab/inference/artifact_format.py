"""What an exported artifact set is, shared by the code that writes, opens, runs and verifies one:
its file names, its endpoints and their abstract signatures, the platform name jax.export uses
here, how a weight tensor is hashed, and the check every call's inputs pass first.

Nine endpoints: prefill and decode (the serving contract, lowered at the manifest's batch) and the
compiled generation loop (lowered with a symbolic batch "b" and prompt width "p"), each for every
cache policy. Weights are an argument of every endpoint and ship once, in ``weights.npz``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.errors import TpulabError
from tpulab.model.decode import ModelFns

ARTIFACT_MANIFEST = "manifest.json"  # the set's manifest (not a checkpoint's, checkpoint/files.py)
WEIGHTS = "weights.npz"
VERIFICATION = "verification.json"
PLATFORMS = ("cpu", "tpu", "cuda")
ENDPOINTS = ("prefill", "decode")  # the serving contract, lowered at the manifest's batch
LOOP = "generate"  # the compiled loop, lowered with a symbolic batch ("b")
ALL_ENDPOINTS = (*ENDPOINTS, LOOP)
CHECKPOINT_DIGEST_KEY = "__checkpoint_digest__"  # the entry of weights.npz naming its checkpoint


def artifact_name(endpoint: str, policy: str) -> str:
    return f"{endpoint}_{policy}"


def refuse(root: Path, message: str) -> NoReturn:
    """The one-line error of every check on an artifact set, naming its directory."""
    raise TpulabError(f"artifacts {root}: {message}")


def current_platform() -> str:
    """The jax.export platform name of the default backend ("gpu" runs as cuda or rocm)."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return "rocm" if "rocm" in dev.client.platform_version.lower() else "cuda"
    return dev.platform


def jax_versions() -> dict:
    return {
        "jax": importlib.metadata.version("jax"),
        "jaxlib": importlib.metadata.version("jaxlib"),
    }


def endpoint_fn(fns: ModelFns, endpoint: str, policy: str):
    """The pure function of (weights, ...) an endpoint is lowered from."""
    if endpoint == "prefill":
        return lambda *a: fns.prefill(policy, *a)
    if endpoint == LOOP:
        return lambda *a: fns.generate(policy, *a)
    return fns.decode


def example_args(fns: ModelFns, endpoint: str, policy: str, batch: int) -> tuple:
    """Abstract arguments: the loop's with a symbolic batch and prompt width ("b", "p"), the others
    at ``batch``."""
    if endpoint != LOOP:
        return fns.example_args(endpoint, policy, batch)
    b, p = jax.export.symbolic_shape("b, p", constraints=(f"p <= {fns.shape.max_len}",))
    return fns.example_args(endpoint, policy, b, p)


def tensor_sha256(x) -> str:
    """sha256 of a tensor's dtype, shape and C-order bytes (the same numbers in another layout
    differ)."""
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.sha256(f"{a.dtype.str}{list(a.shape)}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def tensor_record(x) -> dict:
    a = np.asarray(x)
    return {"shape": list(a.shape), "dtype": a.dtype.name, "sha256": tensor_sha256(a)}


def check_inputs(
    root: Path, name: str, exp: jax.export.Exported, args: tuple, *, partial: bool = False
) -> None:
    """Raise TpulabError unless ``args`` match the endpoint's input tree, shapes and dtypes
    (a symbolic dimension matches any size). ``partial`` checks only the leading arguments given.
    """
    want_tree = jax.tree.unflatten(exp.in_tree, exp.in_avals)[0]
    if partial:
        want_tree = tuple(want_tree[: len(args)])
    if jax.tree.structure(args) != jax.tree.structure(want_tree):
        refuse(
            root,
            f"{name}: inputs have structure {jax.tree.structure(args)}, "
            f"expected {jax.tree.structure(want_tree)}",
        )
    got = jax.tree_util.tree_flatten_with_path(args)[0]
    for (path, x), want in zip(got, jax.tree.leaves(want_tree)):
        shape, dtype = tuple(np.shape(x)), jnp.dtype(getattr(x, "dtype", np.asarray(x).dtype))
        fits = len(shape) == len(want.shape) and all(
            g == w or not isinstance(w, int) for g, w in zip(shape, want.shape)
        )
        if not fits or dtype != want.dtype:
            refuse(
                root,
                f"{name}: input {jax.tree_util.keystr(path)} is {dtype.name}{list(shape)}, "
                f"expected {want.dtype.name}{[str(d) for d in want.shape]}",
            )
