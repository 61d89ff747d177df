"""Writing an exported artifact set: the serialized jax.export endpoints (prefill and decode per
cache policy, the serving contract, plus the compiled generation loop per policy), the weights and
the manifest.

Weights are an argument of every endpoint and ship once, in ``weights.npz``, tagged with the
digest of the checkpoint they came from and listed tensor by tensor (sha256 each) in the manifest.
Each artifact is lowered for several platforms at once (``platforms=("cpu", "tpu", "cuda")``);
the loop is lowered with a symbolic batch size and prompt width, so one artifact serves every
request batch. What the set is: ``artifact_format``; opening it: ``artifacts``; trusting it:
``trust``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, sha256_bytes, sha256_file
from tpulab.config import to_dict
from tpulab.data.tokenizer import DEFINITION
from tpulab.errors import TpulabError
from tpulab.inference.artifact_format import (
    ALL_ENDPOINTS,
    ARTIFACT_MANIFEST,
    CHECKPOINT_DIGEST_KEY,
    PLATFORMS,
    WEIGHTS,
    artifact_name,
    endpoint_fn,
    example_args,
    jax_versions,
    tensor_record,
)
from tpulab.model import kvcache as kv
from tpulab.model.decode import MAX_BATCH, ModelFns
from tpulab.progress import progress

if TYPE_CHECKING:
    from tpulab.train.restore import Restored


def _avals(tree) -> list[dict]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [
        {
            "path": jax.tree_util.keystr(p),
            "shape": [d if isinstance(d, int) else str(d) for d in x.shape],
            "dtype": jnp.dtype(x.dtype).name,
        }
        for p, x in flat
    ]


def export_artifacts(
    source: Restored,
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    batch: int = 1,
    platforms: tuple[str, ...] = PLATFORMS,
) -> dict:
    """Write the nine endpoints, the weights and the manifest for the restored ``source``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise TpulabError(f"export batch={batch} must be an integer in [1, {MAX_BATCH}]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fns = ModelFns(source.model)
    buf = io.BytesIO()
    np.savez(
        buf,
        **{n: np.asarray(x) for n, x in fns.params.items()},
        **{CHECKPOINT_DIGEST_KEY: np.array(source.checkpoint_digest)},
    )
    atomic_write_bytes(out / WEIGHTS, buf.getvalue())
    origin = {
        "checkpoint_step": int(source.step),
        "checkpoint_manifest_sha256": source.checkpoint_digest,
    }
    versions = jax_versions()
    artifacts = []
    for policy, endpoint in progress(
        [(p, e) for p in kv.POLICIES for e in ALL_ENDPOINTS], "export"
    ):
        fn = jax.jit(endpoint_fn(fns, endpoint, policy))
        exported = jax.export.export(fn, platforms=platforms)(
            *example_args(fns, endpoint, policy, batch)
        )
        name = artifact_name(endpoint, policy)
        data = exported.serialize()
        atomic_write_bytes(out / f"{name}.jaxexport", data)
        artifacts.append(
            {
                "name": name,
                "endpoint": endpoint,
                "file": f"{name}.jaxexport",
                "sha256": sha256_bytes(data),
                "inputs": _avals(jax.tree.unflatten(exported.in_tree, exported.in_avals)[0]),
                "outputs": _avals(jax.tree.unflatten(exported.out_tree, exported.out_avals)),
                "platforms": list(exported.platforms),
                "calling_convention_version": exported.calling_convention_version,
                "cache_policy": kv.describe_policy(policy),
                "tokenizer": DEFINITION,
                **versions,
                **origin,
            }
        )
    manifest = {
        "format": 1,
        "batch": batch,
        "max_len": fns.shape.max_len,
        "tokenizer": DEFINITION,
        **versions,
        "source": {
            "run_dir": str(Path(run_dir).resolve()),
            "checkpoint_dir": str(source.checkpoint_dir),
            **origin,
        },
        "model": to_dict(source.config.model),
        "precision": to_dict(source.config.precision),
        "dtypes": {
            "weights": source.config.precision.param_dtype,
            "activations": source.config.precision.compute_dtype,
            "accumulation": source.config.precision.accum_dtype,
            "cache": {p: kv.describe_policy(p)["storage_dtype"] for p in kv.POLICIES},
            "int8_scales": jnp.dtype(kv.SCALE_DTYPE).name,
        },
        "weights": {
            "file": WEIGHTS,
            "sha256": sha256_file(out / WEIGHTS),
            "passed_as": "arguments",
            "tensors": {n: tensor_record(x) for n, x in fns.params.items()},
            **origin,
        },
        "artifacts": artifacts,
    }
    atomic_write_json(out / ARTIFACT_MANIFEST, manifest)
    return manifest
