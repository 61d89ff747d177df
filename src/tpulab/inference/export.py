"""Serialized jax.export endpoints (prefill and decode, per cache policy) with a manifest, and the
checks that stand between those files and anything that runs them.

Weights are an argument of every endpoint and ship once, in ``weights.npz``, tagged with the
digest of the checkpoint they came from: six artifacts share one copy, the artifacts stay small
and weight-independent, and pairing artifacts with another checkpoint's weights is detectable.
Each artifact is lowered for several platforms at once (``platforms=("cpu", "tpu", "cuda")``).

``open_artifacts`` checks, in order: the manifest exists and parses; every listed file exists and
has its sha256; the current platform is listed; the weights carry the manifest's checkpoint
digest and the endpoints' parameter shapes. ``verify_export`` then rebuilds the jitted model from
the checkpoint and compares every endpoint's outputs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, sha256_bytes, sha256_file
from tpulab.config import to_dict
from tpulab.data.tokenizer import DEFINITION
from tpulab.errors import TpulabError
from tpulab.inference import cache as kv
from tpulab.inference.decode import Decoder, ModelFns, pad_prompt

MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
VERIFICATION = "verification.json"
PLATFORMS = ("cpu", "tpu", "cuda")
ENDPOINTS = ("prefill", "decode")
_DIGEST_KEY = "__checkpoint_digest__"
# Max |difference| allowed between an endpoint and the jitted model on this platform: fp32 must be
# bitwise (same computation, same compiler); bf16/int8 get a small stated margin for lowering
# differences in their casts/rounding (in practice they are bitwise too; the table shows it).
TOLERANCE = {"fp32": 0.0, "bf16": 1e-3, "int8": 1e-3}
VERIFY_PROMPT = "ROMEO:\nBut soft, what light"


def artifact_name(endpoint: str, policy: str) -> str:
    return f"{endpoint}_{policy}"


def current_platform() -> str:
    """The jax.export platform name of the default backend ("gpu" runs as cuda or rocm)."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return "rocm" if "rocm" in dev.client.platform_version.lower() else "cuda"
    return dev.platform


def _avals(tree) -> list[dict]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [{"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
            for p, x in flat]


def _versions() -> dict:
    return {"jax": importlib.metadata.version("jax"), "jaxlib": importlib.metadata.version("jaxlib")}


def export_artifacts(source, run_dir: str | Path, out_dir: str | Path, *, batch: int = 1,
                     platforms: tuple[str, ...] = PLATFORMS) -> dict:
    """Write six endpoints, the weights and the manifest for ``source`` (a ``train.restore.Restored``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fns = ModelFns(source.model)
    buf = io.BytesIO()
    np.savez(buf, **{n: np.asarray(x) for n, x in fns.params.items()},
             **{_DIGEST_KEY: np.array(source.checkpoint_digest)})
    atomic_write_bytes(out / WEIGHTS, buf.getvalue())
    origin = {"checkpoint_step": int(source.step), "checkpoint_manifest_sha256": source.checkpoint_digest}
    versions = _versions()
    artifacts = []
    for policy in kv.POLICIES:
        for endpoint in ENDPOINTS:
            fn = jax.jit(lambda *a, _p=policy: fns.prefill(_p, *a)) if endpoint == "prefill" else jax.jit(fns.decode)
            exported = jax.export.export(fn, platforms=platforms)(*fns.example_args(endpoint, policy, batch))
            name = artifact_name(endpoint, policy)
            data = exported.serialize()
            atomic_write_bytes(out / f"{name}.jaxexport", data)
            artifacts.append({
                "name": name, "endpoint": endpoint, "file": f"{name}.jaxexport", "sha256": sha256_bytes(data),
                "inputs": _avals(jax.tree.unflatten(exported.in_tree, exported.in_avals)[0]),
                "outputs": _avals(jax.tree.unflatten(exported.out_tree, exported.out_avals)),
                "platforms": list(exported.platforms),
                "calling_convention_version": exported.calling_convention_version,
                "cache_policy": kv.describe_policy(policy), "tokenizer": DEFINITION, **versions, **origin,
            })
    manifest = {
        "format": 1, "batch": batch, "max_len": fns.shape.max_len, "tokenizer": DEFINITION, **versions,
        "source": {"run_dir": str(Path(run_dir).resolve()), "checkpoint_dir": str(source.checkpoint_dir), **origin},
        "model": to_dict(source.config.model), "precision": to_dict(source.config.precision),
        "dtypes": {"weights": source.config.precision.param_dtype,
                   "activations": source.config.precision.compute_dtype,
                   "accumulation": source.config.precision.accum_dtype,
                   "cache": {p: kv.describe_policy(p)["storage_dtype"] for p in kv.POLICIES},
                   "int8_scales": jnp.dtype(kv.SCALE_DTYPE).name},
        "weights": {"file": WEIGHTS, "sha256": sha256_file(out / WEIGHTS), "passed_as": "arguments",
                    "tensors": len(fns.names), **origin},
        "artifacts": artifacts,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


@dataclasses.dataclass
class ArtifactSet:
    """An opened, hash-checked artifact directory: manifest, deserialized endpoints, weights."""

    root: Path
    manifest: dict
    manifest_sha256: str
    exported: dict[str, jax.export.Exported]
    params: dict[str, np.ndarray]

    @property
    def max_len(self) -> int:
        return int(self.manifest["max_len"])

    def identity(self) -> dict:
        src = self.manifest["source"]
        return {"manifest_sha256": self.manifest_sha256, "checkpoint_step": src["checkpoint_step"],
                "checkpoint_manifest_sha256": src["checkpoint_manifest_sha256"],
                "cache_policies": {p: kv.describe_policy(p) for p in kv.POLICIES},
                "platforms": self.manifest["artifacts"][0]["platforms"], "max_len": self.max_len}

    def engine(self, policy: str) -> "ExportedEngine":
        return ExportedEngine(self, kv.check_policy(policy))


def _fail(root: Path, message: str):
    raise TpulabError(f"artifacts {root}: {message}")


def open_artifacts(root: str | Path) -> ArtifactSet:
    """Check hashes, platform and weight pairing; deserialize. Raises TpulabError naming the first problem."""
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.is_file():
        _fail(root, f"missing {MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text())
        entries = [*manifest["artifacts"], manifest["weights"]]
        source = manifest["source"]
    except (ValueError, KeyError, TypeError):
        _fail(root, f"{MANIFEST} is not a valid manifest")
    for entry in entries:
        path = root / entry["file"]
        if not path.is_file():
            _fail(root, f"missing file {entry['file']} (listed in {MANIFEST})")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            _fail(root, f"sha256 mismatch in {entry['file']}: file {digest[:12]}, manifest {entry['sha256'][:12]}")
    here = current_platform()
    names = {a["name"] for a in manifest["artifacts"]}
    wanted = {artifact_name(e, p) for e in ENDPOINTS for p in kv.POLICIES}
    if names != wanted:
        _fail(root, f"manifest lists artifacts {sorted(names)}, expected {sorted(wanted)}")
    exported = {}
    for a in manifest["artifacts"]:
        if here not in a["platforms"]:
            _fail(root, f"{a['name']} was lowered for {', '.join(a['platforms'])}, not for this platform ({here})")
        exp = jax.export.deserialize(bytearray((root / a["file"]).read_bytes()))
        if here not in exp.platforms:
            _fail(root, f"{a['name']} holds code for {', '.join(exp.platforms)}, not for this platform ({here})")
        if a["checkpoint_manifest_sha256"] != source["checkpoint_manifest_sha256"]:
            _fail(root, f"{a['name']} came from checkpoint {a['checkpoint_manifest_sha256'][:12]}, "
                        f"the set from {source['checkpoint_manifest_sha256'][:12]}")
        exported[a["name"]] = exp
    with np.load(root / manifest["weights"]["file"], allow_pickle=False) as z:
        params = {k: z[k] for k in z.files}
    weights_from = str(params.pop(_DIGEST_KEY, ""))
    if weights_from != source["checkpoint_manifest_sha256"]:
        _fail(root, f"weights came from checkpoint {weights_from[:12] or '?'}, the artifacts from "
                    f"{source['checkpoint_manifest_sha256'][:12]}")
    check_inputs(root, "weights", exported[artifact_name("prefill", "fp32")], (params,), partial=True)
    return ArtifactSet(root, manifest, sha256_file(mpath), exported, params)


def check_inputs(root: Path, name: str, exp: jax.export.Exported, args: tuple, *, partial: bool = False) -> None:
    """Raise TpulabError unless ``args`` match the endpoint's input tree, shapes and dtypes.

    ``partial`` checks only the leading arguments given.
    """
    want_tree = jax.tree.unflatten(exp.in_tree, exp.in_avals)[0]
    if partial:
        want_tree = tuple(want_tree[: len(args)])
    if jax.tree.structure(args) != jax.tree.structure(want_tree):
        _fail(root, f"{name}: inputs have structure {jax.tree.structure(args)}, "
                    f"expected {jax.tree.structure(want_tree)}")
    got = jax.tree_util.tree_flatten_with_path(args)[0]
    for (path, x), want in zip(got, jax.tree.leaves(want_tree)):
        shape, dtype = tuple(np.shape(x)), jnp.dtype(getattr(x, "dtype", np.asarray(x).dtype))
        if shape != tuple(want.shape) or dtype != want.dtype:
            _fail(root, f"{name}: input {jax.tree_util.keystr(path)} is {dtype.name}{list(shape)}, "
                        f"expected {want.dtype.name}{list(want.shape)}")


class ExportedEngine:
    """The Engine interface over deserialized endpoints; inputs are checked before every call."""

    def __init__(self, art: ArtifactSet, policy: str):
        self.art, self.policy = art, policy
        self.max_len, self.batch = art.max_len, int(art.manifest["batch"])
        self._prefill = art.exported[artifact_name("prefill", policy)]
        self._decode = art.exported[artifact_name("decode", policy)]
        self._params = jax.device_put(art.params)

    def _call(self, exp, name, *args):
        check_inputs(self.art.root, name, exp, (self.art.params, *args))
        return exp.call(self._params, *args)

    def prefill(self, tokens_bs, length):
        return self._call(self._prefill, artifact_name("prefill", self.policy), tokens_bs, length)

    def decode(self, cache, token_b, pos):
        return self._call(self._decode, artifact_name("decode", self.policy), cache, token_b, pos)


def _max_diff(a, b) -> tuple[float, bool]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0, bool(np.array_equal(a, b))


def _compare(got, ref, policy: str) -> dict:
    """Logits and every cache buffer (dequantized), exported vs jitted."""
    (lg, cache_g), (lr, cache_r) = got, ref
    diffs = [_max_diff(lg, lr)]
    for layer in range(cache_g.k.shape[0]):
        for a, b in zip(kv.read(cache_g, layer, jnp.float32), kv.read(cache_r, layer, jnp.float32)):
            diffs.append(_max_diff(a, b))
    worst = max(d for d, _ in diffs)
    bitwise = all(eq for _, eq in diffs)
    tol = TOLERANCE[policy]
    return {"max_abs_diff": worst, "bitwise": bitwise, "tolerance": "bitwise" if tol == 0 else f"<= {tol:g}",
            "passed": bitwise if tol == 0 else worst <= tol}


def verify_export(root: str | Path, run_dir: str | Path | None = None) -> dict:
    """Open (hash/platform/pairing checks), rebuild the model from its checkpoint, compare every endpoint.

    Returns ``{"rows": [...], "passed": bool, ...}`` and records it in ``root/verification.json``,
    which ``serve`` requires. Pairing problems raise TpulabError; numeric mismatches are failed rows.
    """
    from tpulab.train.restore import load_model

    art = open_artifacts(root)
    src = art.manifest["source"]
    restored = load_model(run_dir or src["run_dir"], src["checkpoint_step"])
    if restored.checkpoint_digest != src["checkpoint_manifest_sha256"]:
        _fail(art.root, f"checkpoint {restored.checkpoint_dir} (step {restored.step}) has digest "
                        f"{restored.checkpoint_digest[:12]}; the artifacts were exported from "
                        f"{src['checkpoint_manifest_sha256'][:12]}")
    fns = ModelFns(restored.model)
    check_inputs(art.root, "checkpoint weights", art.exported[artifact_name("prefill", "fp32")],
                 (fns.params,), partial=True)
    from tpulab.inference.generate import prompt_ids

    ids = prompt_ids(VERIFY_PROMPT[: art.max_len // 2], art.max_len, 1)
    tokens = pad_prompt(ids, art.max_len, art.manifest["batch"])
    length = np.int32(len(ids))
    rows = []
    for policy in kv.POLICIES:
        engine, ref = art.engine(policy), Decoder(fns, policy)
        got_p, ref_p = engine.prefill(tokens, length), ref.prefill(tokens, length)
        nxt = np.full((art.manifest["batch"],), int(np.argmax(np.asarray(ref_p[0])[0])), np.int32)
        got_d = engine.decode(got_p[1], nxt, length)
        ref_d = ref._decode(ref.params, jax.tree.map(jnp.copy, ref_p[1]), jnp.asarray(nxt), jnp.asarray(length))
        for endpoint, got, want in (("prefill", got_p, ref_p), ("decode", got_d, ref_d)):
            rows.append({"artifact": artifact_name(endpoint, policy), "platform": current_platform(),
                         **_compare(got, want, policy)})
    result = {"manifest_sha256": art.manifest_sha256, "platform": current_platform(),
              "checkpoint_step": restored.step, "checkpoint_manifest_sha256": restored.checkpoint_digest,
              "passed": all(r["passed"] for r in rows), "rows": rows, **_versions()}
    atomic_write_json(art.root / VERIFICATION, result)
    return result


def require_verified(art: ArtifactSet) -> dict:
    """The verification record for exactly this manifest on this platform, all rows passed; else raise."""
    path = art.root / VERIFICATION
    if not path.is_file():
        _fail(art.root, f"not verified (run: tpulab verify-export {art.root})")
    try:
        record = json.loads(path.read_text())
    except ValueError:
        _fail(art.root, f"{VERIFICATION} is not valid JSON (run: tpulab verify-export {art.root})")
    if record.get("manifest_sha256") != art.manifest_sha256:
        _fail(art.root, f"{VERIFICATION} is for another manifest (run: tpulab verify-export {art.root})")
    if record.get("platform") != current_platform():
        _fail(art.root, f"verified on {record.get('platform')}, not on {current_platform()}")
    if not record.get("passed"):
        _fail(art.root, "verification failed; see verification.json")
    return record


def verification_table(result: dict) -> str:
    lines = ["| artifact | platform | bitwise | max abs diff | tolerance | result |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['artifact']} | {r['platform']} | {'yes' if r['bitwise'] else 'no'} | "
                     f"{r['max_abs_diff']:.3g} | {r['tolerance']} | {'PASS' if r['passed'] else 'FAIL'} |")
    return "\n".join(lines)
