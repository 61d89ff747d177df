"""Opening an exported artifact set: every check that stands between its files and anything
that runs them.

``open_artifacts`` checks, in order: the manifest exists and parses; every listed file exists and
has its sha256; every weight tensor has its sha256; the current platform is listed; every artifact
deserializes and has exactly the input/output shapes its name implies for the manifest's model
(a corrupt or swapped file is refused by name); the weights carry the manifest's checkpoint digest
and the model's parameter shapes. Whether the set is *trusted* (checked against its checkpoint, or
a verification record) is ``trust.py``'s question.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.checkpoint.files import sha256_file
from tpulab.errors import TpulabError
from tpulab.inference.artifact_format import (
    ALL_ENDPOINTS,
    ARTIFACT_MANIFEST,
    CHECKPOINT_DIGEST_KEY,
    LOOP,
    WEIGHTS,
    artifact_name,
    check_inputs,
    current_platform,
    endpoint_fn,
    example_args,
    refuse,
    tensor_sha256,
)
from tpulab.inference.runner import ExportedEngine
from tpulab.model import kvcache as kv
from tpulab.model.decode import ModelFns


@dataclasses.dataclass
class ArtifactSet:
    """An opened, hash-checked, shape-checked artifact directory: manifest, endpoints, weights."""

    root: Path
    manifest: dict
    manifest_sha256: str
    file_sha256: dict[str, str]  # every file as read at open: what a verification record must match
    exported: dict[str, jax.export.Exported]
    params: dict[str, np.ndarray]
    verification: dict | None = None  # how this set was verified (``load_verified``)

    @property
    def max_len(self) -> int:
        return int(self.manifest["max_len"])

    def identity(self) -> dict:
        src = self.manifest["source"]
        return {
            "manifest_sha256": self.manifest_sha256,
            "checkpoint_step": src["checkpoint_step"],
            "checkpoint_manifest_sha256": src["checkpoint_manifest_sha256"],
            "cache_policies": {p: kv.describe_policy(p) for p in kv.POLICIES},
            "platforms": self.manifest["artifacts"][0]["platforms"],
            "max_len": self.max_len,
            "verification": self.verification,
        }

    def engine(self, policy: str) -> ExportedEngine:
        return ExportedEngine(
            self.root,
            kv.check_policy(policy),
            self.exported,
            self.params,
            self.max_len,
            int(self.manifest["batch"]),
        )


def abstract_fns(manifest: dict) -> ModelFns:
    """ModelFns of the manifest's model config with abstract weights: the shapes every artifact
    must have."""
    from flax import nnx

    from tpulab.config import from_dict
    from tpulab.model.config import ModelConfig, PrecisionConfig
    from tpulab.model.transformer import Transformer

    cfg, prec = (
        from_dict(ModelConfig, manifest["model"]),
        from_dict(PrecisionConfig, manifest["precision"]),
    )
    return ModelFns(nnx.eval_shape(lambda: Transformer(cfg, prec, rngs=nnx.Rngs(0))))


def _aval_text(avals) -> list[str]:
    return [f"{jnp.dtype(a.dtype).name}{[str(d) for d in a.shape]}" for a in avals]


def _check_artifact(
    root: Path, name: str, exp: jax.export.Exported, fns: ModelFns, batch: int
) -> None:
    """The deserialized artifact computes what its name says: same input and output trees,
    shapes, dtypes."""
    endpoint, policy = name.split("_", 1)
    args = example_args(fns, endpoint, policy, batch)
    want_in = jax.tree.leaves(args)
    want_out = jax.tree.leaves(jax.eval_shape(endpoint_fn(fns, endpoint, policy), *args))
    got_in, got_out = list(exp.in_avals), list(exp.out_avals)
    if exp.in_tree != jax.tree.structure((args, {})) or _aval_text(got_in) != _aval_text(want_in):
        refuse(
            root,
            f"{name}.jaxexport does not take the inputs of {name} (swapped or foreign artifact?)",
        )
    if _aval_text(got_out) != _aval_text(want_out):
        refuse(
            root,
            f"{name}.jaxexport does not return the outputs of {name} "
            "(swapped or foreign artifact?)",
        )
    if endpoint == LOOP and _loop_cache_types(exp.mlir_module(), fns) != _loop_cache_types(
        None, fns, policy
    ):
        # The loop's signature is the same for every policy (its cache is internal): read the cache
        # buffers' element type from the program itself.
        refuse(
            root, f"{name}.jaxexport does not hold a {policy} cache (swapped or foreign artifact?)"
        )


_MLIR_ELEMENT = {"fp32": "f32", "bf16": "bf16", "int8": "i8"}


def _loop_cache_types(
    module_text: str | None, fns: ModelFns, policy: str | None = None
) -> set[str]:
    """The [layers, ?, S, heads, *] tensor types a loop program holds (or should hold for
    ``policy``)."""
    c = fns.shape
    prefix = f"tensor<{c.n_layers}x?x{c.max_len}x{c.n_heads}x"
    if module_text is None:
        want = {f"{prefix}{c.head_dim}x{_MLIR_ELEMENT[policy]}>"}
        return want | ({f"{prefix}1xf32>"} if policy == "int8" else set())
    return set(re.findall(re.escape(prefix) + r"\d+x\w+>", module_text))


def open_artifacts(root: str | Path) -> ArtifactSet:
    """Check hashes, platform, artifact shapes and weight pairing; deserialize. Raises TpulabError
    naming the first problem (and the file it is in)."""
    root = Path(root)
    mpath = root / ARTIFACT_MANIFEST
    if not mpath.is_file():
        refuse(root, f"missing {ARTIFACT_MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text())
        entries = [*manifest["artifacts"], manifest["weights"]]
        source = manifest["source"]
        batch = int(manifest["batch"])
        tensors = dict(manifest["weights"]["tensors"])
        for entry in entries:
            str(entry["file"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        refuse(root, f"{ARTIFACT_MANIFEST} is not a valid manifest")
    file_sha256 = {}
    for entry in entries:
        path = root / entry["file"]
        if not path.is_file():
            refuse(root, f"missing file {entry['file']} (listed in {ARTIFACT_MANIFEST})")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            refuse(
                root,
                f"sha256 mismatch in {entry['file']}: file {digest[:12]}, "
                f"manifest {entry['sha256'][:12]}",
            )
        file_sha256[entry["file"]] = digest
    here = current_platform()
    names = {a["name"] for a in manifest["artifacts"]}
    wanted = {artifact_name(e, p) for e in ALL_ENDPOINTS for p in kv.POLICIES}
    if names != wanted:
        refuse(root, f"manifest lists artifacts {sorted(names)}, expected {sorted(wanted)}")
    try:
        fns = abstract_fns(manifest)
    except TpulabError as e:
        refuse(root, f"{ARTIFACT_MANIFEST} describes no valid model ({e})")
    exported = {}
    for a in manifest["artifacts"]:
        if here not in a["platforms"]:
            refuse(
                root,
                f"{a['name']} was lowered for {', '.join(a['platforms'])}, "
                f"not for this platform ({here})",
            )
        try:
            exp = jax.export.deserialize(bytearray((root / a["file"]).read_bytes()))
            # Parse the StableHLO too: corrupt bytecode fails here, not at the first call.
            exp.mlir_module()
        except Exception as e:  # a corrupt file raises anything from IndexError to MLIRError
            refuse(
                root,
                f"{a['file']} cannot be deserialized ({type(e).__name__}); the file is corrupt",
            )
        if here not in exp.platforms:
            refuse(
                root,
                f"{a['name']} holds code for {', '.join(exp.platforms)}, "
                f"not for this platform ({here})",
            )
        if a["checkpoint_manifest_sha256"] != source["checkpoint_manifest_sha256"]:
            refuse(
                root,
                f"{a['name']} came from checkpoint {a['checkpoint_manifest_sha256'][:12]}, "
                f"the set from {source['checkpoint_manifest_sha256'][:12]}",
            )
        _check_artifact(root, a["name"], exp, fns, batch)
        exported[a["name"]] = exp
    try:
        with np.load(root / manifest["weights"]["file"], allow_pickle=False) as z:
            params = {k: z[k] for k in z.files}
    except Exception as e:  # a zip that hashes right but does not parse (hash rewritten to match)
        refuse(root, f"{WEIGHTS} cannot be read ({type(e).__name__})")
    weights_from = str(params.pop(CHECKPOINT_DIGEST_KEY, ""))
    if weights_from != source["checkpoint_manifest_sha256"]:
        refuse(
            root,
            f"weights came from checkpoint {weights_from[:12] or '?'}, the artifacts from "
            f"{source['checkpoint_manifest_sha256'][:12]}",
        )
    if set(params) != set(tensors):
        refuse(
            root,
            f"{WEIGHTS} holds tensors {sorted(set(params) ^ set(tensors))[:3]} "
            "not matching the manifest",
        )
    for n, x in params.items():
        if tensor_sha256(x) != tensors[n].get("sha256"):
            refuse(
                root,
                f"{WEIGHTS}: tensor {n} does not have the sha256 recorded in {ARTIFACT_MANIFEST}",
            )
    check_inputs(
        root, "weights", exported[artifact_name("prefill", "fp32")], (params,), partial=True
    )
    return ArtifactSet(root, manifest, sha256_file(mpath), file_sha256, exported, params)
