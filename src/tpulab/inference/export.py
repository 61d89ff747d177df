"""Serialized jax.export endpoints (prefill and decode per cache policy, the serving contract, plus
the compiled generation loop per policy) with a manifest, and the checks that stand between those
files and anything that runs them.

Weights are an argument of every endpoint and ship once, in ``weights.npz``, tagged with the
digest of the checkpoint they came from and listed tensor by tensor (sha256 each) in the manifest.
Each artifact is lowered for several platforms at once (``platforms=("cpu", "tpu", "cuda")``);
the loop is lowered with a symbolic batch size and prompt width, so one artifact serves every
request batch.

``open_artifacts`` checks, in order: the manifest exists and parses; every listed file exists and
has its sha256; every weight tensor has its sha256; the current platform is listed; every artifact
deserializes and has exactly the input/output shapes its name implies for the manifest's model
(a corrupt or swapped file is refused by name); the weights carry the manifest's checkpoint digest
and the model's parameter shapes. ``verify_export`` then restores the checkpoint (verified by its
own manifest), compares every weight tensor bitwise with it, and compares every endpoint's outputs
with the jitted model; it writes ``verification.json`` listing the sha256 of every file it checked
(HMAC-signed when given a key). ``load_verified`` is what ``serve`` and ``generate`` call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
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
from tpulab.inference.decode import (
    MAX_BATCH,
    Decoder,
    ModelFns,
    batch_bucket,
    pad_prompt,
    width_bucket,
)
from tpulab.progress import progress

MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
VERIFICATION = "verification.json"
PLATFORMS = ("cpu", "tpu", "cuda")
ENDPOINTS = ("prefill", "decode")  # the serving contract, lowered at the manifest's batch
LOOP = "generate"  # the compiled loop, lowered with a symbolic batch ("b")
ALL_ENDPOINTS = (*ENDPOINTS, LOOP)
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
    return [
        {
            "path": jax.tree_util.keystr(p),
            "shape": [d if isinstance(d, int) else str(d) for d in x.shape],
            "dtype": jnp.dtype(x.dtype).name,
        }
        for p, x in flat
    ]


def _versions() -> dict:
    return {
        "jax": importlib.metadata.version("jax"),
        "jaxlib": importlib.metadata.version("jaxlib"),
    }


def _endpoint_fn(fns: ModelFns, endpoint: str, policy: str):
    if endpoint == "prefill":
        return lambda *a: fns.prefill(policy, *a)
    if endpoint == LOOP:
        return lambda *a: fns.generate(policy, *a)
    return fns.decode


def _batch_dim(endpoint: str, batch: int):
    return jax.export.symbolic_shape("b")[0] if endpoint == LOOP else batch


def _example_args(fns: ModelFns, endpoint: str, policy: str, batch: int) -> tuple:
    """The loop is lowered with a symbolic batch and prompt width ("b", "p"); the others at ``batch``."""
    if endpoint != LOOP:
        return fns.example_args(endpoint, policy, batch)
    b, p = jax.export.symbolic_shape("b, p", constraints=(f"p <= {fns.shape.max_len}",))
    return fns.example_args(endpoint, policy, b, p)


def tensor_sha256(x) -> str:
    """sha256 of a tensor's dtype, shape and C-order bytes (the same numbers in another layout differ)."""
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.sha256(f"{a.dtype.str}{list(a.shape)}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def tensor_record(x) -> dict:
    a = np.asarray(x)
    return {"shape": list(a.shape), "dtype": a.dtype.name, "sha256": tensor_sha256(a)}


def export_artifacts(
    source,
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    batch: int = 1,
    platforms: tuple[str, ...] = PLATFORMS,
) -> dict:
    """Write six endpoints, the weights and the manifest for ``source`` (a ``train.restore.Restored``)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise TpulabError(f"export batch={batch} must be an integer in [1, {MAX_BATCH}]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fns = ModelFns(source.model)
    buf = io.BytesIO()
    np.savez(
        buf,
        **{n: np.asarray(x) for n, x in fns.params.items()},
        **{_DIGEST_KEY: np.array(source.checkpoint_digest)},
    )
    atomic_write_bytes(out / WEIGHTS, buf.getvalue())
    origin = {
        "checkpoint_step": int(source.step),
        "checkpoint_manifest_sha256": source.checkpoint_digest,
    }
    versions = _versions()
    artifacts = []
    for policy, endpoint in progress(
        [(p, e) for p in kv.POLICIES for e in ALL_ENDPOINTS], "export"
    ):
        fn = jax.jit(_endpoint_fn(fns, endpoint, policy))
        exported = jax.export.export(fn, platforms=platforms)(
            *_example_args(fns, endpoint, policy, batch)
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
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


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
        return ExportedEngine(self, kv.check_policy(policy))


def _fail(root: Path, message: str):
    raise TpulabError(f"artifacts {root}: {message}")


def abstract_fns(manifest: dict) -> ModelFns:
    """ModelFns of the manifest's model config with abstract weights: the shapes every artifact must have."""
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
    """The deserialized artifact computes what its name says: same input and output trees, shapes, dtypes."""
    endpoint, policy = name.split("_", 1)
    args = _example_args(fns, endpoint, policy, batch)
    want_in = jax.tree.leaves(args)
    want_out = jax.tree.leaves(jax.eval_shape(_endpoint_fn(fns, endpoint, policy), *args))
    got_in, got_out = list(exp.in_avals), list(exp.out_avals)
    if exp.in_tree != jax.tree.structure((args, {})) or _aval_text(got_in) != _aval_text(want_in):
        _fail(
            root,
            f"{name}.jaxexport does not take the inputs of {name} (swapped or foreign artifact?)",
        )
    if _aval_text(got_out) != _aval_text(want_out):
        _fail(
            root,
            f"{name}.jaxexport does not return the outputs of {name} (swapped or foreign artifact?)",
        )
    if endpoint == LOOP and _loop_cache_types(exp.mlir_module(), fns) != _loop_cache_types(
        None, fns, policy
    ):
        # The loop's signature is the same for every policy (its cache is internal): read the cache
        # buffers' element type from the program itself.
        _fail(
            root, f"{name}.jaxexport does not hold a {policy} cache (swapped or foreign artifact?)"
        )


_MLIR_ELEMENT = {"fp32": "f32", "bf16": "bf16", "int8": "i8"}


def _loop_cache_types(
    module_text: str | None, fns: ModelFns, policy: str | None = None
) -> set[str]:
    """The [layers, ?, S, heads, *] tensor types a loop program holds (or should hold for ``policy``)."""
    import re

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
    mpath = root / MANIFEST
    if not mpath.is_file():
        _fail(root, f"missing {MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text())
        entries = [*manifest["artifacts"], manifest["weights"]]
        source = manifest["source"]
        batch = int(manifest["batch"])
        tensors = dict(manifest["weights"]["tensors"])
        for entry in entries:
            str(entry["file"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        _fail(root, f"{MANIFEST} is not a valid manifest")
    file_sha256 = {}
    for entry in entries:
        path = root / entry["file"]
        if not path.is_file():
            _fail(root, f"missing file {entry['file']} (listed in {MANIFEST})")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            _fail(
                root,
                f"sha256 mismatch in {entry['file']}: file {digest[:12]}, manifest {entry['sha256'][:12]}",
            )
        file_sha256[entry["file"]] = digest
    here = current_platform()
    names = {a["name"] for a in manifest["artifacts"]}
    wanted = {artifact_name(e, p) for e in ALL_ENDPOINTS for p in kv.POLICIES}
    if names != wanted:
        _fail(root, f"manifest lists artifacts {sorted(names)}, expected {sorted(wanted)}")
    try:
        fns = abstract_fns(manifest)
    except TpulabError as e:
        _fail(root, f"{MANIFEST} describes no valid model ({e})")
    exported = {}
    for a in manifest["artifacts"]:
        if here not in a["platforms"]:
            _fail(
                root,
                f"{a['name']} was lowered for {', '.join(a['platforms'])}, not for this platform ({here})",
            )
        try:
            exp = jax.export.deserialize(bytearray((root / a["file"]).read_bytes()))
            exp.mlir_module()  # parse the StableHLO too: corrupt bytecode fails here, not at the first call
        except (
            Exception
        ) as e:  # a corrupt flatbuffer or module raises anything from IndexError to MLIRError
            _fail(
                root,
                f"{a['file']} cannot be deserialized ({type(e).__name__}); the file is corrupt",
            )
        if here not in exp.platforms:
            _fail(
                root,
                f"{a['name']} holds code for {', '.join(exp.platforms)}, not for this platform ({here})",
            )
        if a["checkpoint_manifest_sha256"] != source["checkpoint_manifest_sha256"]:
            _fail(
                root,
                f"{a['name']} came from checkpoint {a['checkpoint_manifest_sha256'][:12]}, "
                f"the set from {source['checkpoint_manifest_sha256'][:12]}",
            )
        _check_artifact(root, a["name"], exp, fns, batch)
        exported[a["name"]] = exp
    try:
        with np.load(root / manifest["weights"]["file"], allow_pickle=False) as z:
            params = {k: z[k] for k in z.files}
    except (
        Exception
    ) as e:  # a zip that hashes right but does not parse (forged with its hash rewritten)
        _fail(root, f"{WEIGHTS} cannot be read ({type(e).__name__})")
    weights_from = str(params.pop(_DIGEST_KEY, ""))
    if weights_from != source["checkpoint_manifest_sha256"]:
        _fail(
            root,
            f"weights came from checkpoint {weights_from[:12] or '?'}, the artifacts from "
            f"{source['checkpoint_manifest_sha256'][:12]}",
        )
    if set(params) != set(tensors):
        _fail(
            root,
            f"{WEIGHTS} holds tensors {sorted(set(params) ^ set(tensors))[:3]} not matching the manifest",
        )
    for n, x in params.items():
        if tensor_sha256(x) != tensors[n].get("sha256"):
            _fail(root, f"{WEIGHTS}: tensor {n} does not have the sha256 recorded in {MANIFEST}")
    check_inputs(
        root, "weights", exported[artifact_name("prefill", "fp32")], (params,), partial=True
    )
    return ArtifactSet(root, manifest, sha256_file(mpath), file_sha256, exported, params)


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
        _fail(
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
            _fail(
                root,
                f"{name}: input {jax.tree_util.keystr(path)} is {dtype.name}{list(shape)}, "
                f"expected {want.dtype.name}{[str(d) for d in want.shape]}",
            )


class ExportedEngine:
    """The Engine interface over deserialized endpoints; inputs are checked before every call."""

    def __init__(self, art: ArtifactSet, policy: str):
        self.art, self.policy = art, policy
        self.max_len, self.batch = art.max_len, int(art.manifest["batch"])
        self._prefill = art.exported[artifact_name("prefill", policy)]
        self._decode = art.exported[artifact_name("decode", policy)]
        self._loop = art.exported[artifact_name(LOOP, policy)]
        self._loop_jit = jax.jit(self._loop.call)  # one executable per batch bucket
        self._params = jax.device_put(art.params)

    def _call(self, exp, name, *args):
        check_inputs(self.art.root, name, exp, (self.art.params, *args))
        return exp.call(self._params, *args)

    def prefill(self, tokens_bs, length):
        return self._call(self._prefill, artifact_name("prefill", self.policy), tokens_bs, length)

    def decode(self, cache, token_b, pos):
        return self._call(self._decode, artifact_name("decode", self.policy), cache, token_b, pos)

    def generate(
        self, tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token
    ):
        args = (tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token)
        check_inputs(
            self.art.root, artifact_name(LOOP, self.policy), self._loop, (self.art.params, *args)
        )
        return self._loop_jit(self._params, *args)

    @staticmethod
    def batch_for(n: int) -> int:
        return batch_bucket(n)

    def width_for(self, n: int) -> int:
        return width_bucket(n, self.max_len)

    def compiled_variants(self) -> int:
        return self._loop_jit._cache_size()


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
    return {
        "max_abs_diff": worst,
        "bitwise": bitwise,
        "tolerance": "bitwise" if tol == 0 else f"<= {tol:g}",
        "passed": bitwise if tol == 0 else worst <= tol,
    }


def compare_weights(art: ArtifactSet, params: dict, step: int) -> None:
    """Every tensor of weights.npz bitwise equal to the checkpoint's (names, dtypes, shapes, bytes)."""
    names = set(art.params)
    if names != set(params):
        _fail(
            art.root,
            f"{WEIGHTS} and checkpoint step {step} hold different tensors: "
            f"{sorted(names ^ set(params))[:3]}",
        )
    for n in sorted(names):
        a, b = np.asarray(art.params[n]), np.asarray(params[n])
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            _fail(
                art.root,
                f"{WEIGHTS}: tensor {n} differs from checkpoint step {step} (forged or foreign weights)",
            )


def _loop_compare(art: ArtifactSet, fns: ModelFns, policy: str) -> dict:
    """The exported loop against the jitted loop on a ragged batch of two (one greedy row, one sampled)."""
    from tpulab.inference.generate import Request, batch_arrays
    from tpulab.inference.sampling import SamplingConfig

    s = art.max_len
    prompts = (VERIFY_PROMPT[: s // 2], VERIFY_PROMPT[: s // 4])
    cfgs = (
        SamplingConfig(max_new=s // 4, temperature=0.0),
        SamplingConfig(max_new=s // 4, temperature=0.9, seed=1),
    )
    reqs = [Request.of(p, c, s) for p, c in zip(prompts, cfgs)]
    args = batch_arrays(reqs, s, 2) + (np.int32(-1),)
    got = art.engine(policy).generate(*args)
    want = Decoder(fns, policy).generate(*args)
    differ = sum(int(np.sum(np.asarray(g) != np.asarray(w))) for g, w in zip(got, want))
    return {
        "artifact": artifact_name(LOOP, policy),
        "platform": current_platform(),
        "max_abs_diff": float(differ),
        "bitwise": differ == 0,
        "tolerance": "same tokens",
        "passed": differ == 0,
    }


def _check_against_checkpoint(art: ArtifactSet, run_dir) -> tuple[list[dict], object]:
    """Restore the checkpoint the manifest names (its manifest verified), compare weights bitwise and
    every endpoint's outputs. Pairing problems raise; numeric mismatches are failed rows."""
    from tpulab.inference.generate import prompt_ids
    from tpulab.train.restore import load_model

    src = art.manifest["source"]
    restored = load_model(run_dir or src["run_dir"], src["checkpoint_step"])
    if restored.checkpoint_digest != src["checkpoint_manifest_sha256"]:
        _fail(
            art.root,
            f"checkpoint {restored.checkpoint_dir} (step {restored.step}) has digest "
            f"{restored.checkpoint_digest[:12]}; the artifacts were exported from "
            f"{src['checkpoint_manifest_sha256'][:12]}",
        )
    fns = ModelFns(restored.model)
    check_inputs(
        art.root,
        "checkpoint weights",
        art.exported[artifact_name("prefill", "fp32")],
        (fns.params,),
        partial=True,
    )
    compare_weights(art, fns.params, restored.step)
    ids = prompt_ids(VERIFY_PROMPT[: art.max_len // 2], art.max_len, 1)
    tokens = pad_prompt(ids, art.max_len, art.manifest["batch"])
    length = np.int32(len(ids))
    rows = []
    for policy in kv.POLICIES:
        engine, ref = art.engine(policy), Decoder(fns, policy)
        got_p, ref_p = engine.prefill(tokens, length), ref.prefill(tokens, length)
        nxt = np.full((art.manifest["batch"],), int(np.argmax(np.asarray(ref_p[0])[0])), np.int32)
        got_d = engine.decode(got_p[1], nxt, length)
        ref_d = ref._decode(
            ref.params, jax.tree.map(jnp.copy, ref_p[1]), jnp.asarray(nxt), jnp.asarray(length)
        )
        for endpoint, got, want in (("prefill", got_p, ref_p), ("decode", got_d, ref_d)):
            rows.append(
                {
                    "artifact": artifact_name(endpoint, policy),
                    "platform": current_platform(),
                    **_compare(got, want, policy),
                }
            )
        rows.append(_loop_compare(art, fns, policy))
    return rows, restored


def read_key(key_file: str | Path | None) -> bytes | None:
    """The HMAC key (the file's bytes); refuses a missing or empty file."""
    if key_file is None:
        return None
    path = Path(key_file)
    try:
        key = path.read_bytes()
    except OSError as e:
        raise TpulabError(f"key file {path}: {e.strerror or e}") from None
    if len(key.strip()) < 16:
        raise TpulabError(
            f"key file {path} holds {len(key.strip())} bytes; use at least 16 random bytes"
        )
    return key


def _canonical(record: dict) -> bytes:
    body = {k: v for k, v in record.items() if k != "hmac_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _sign(record: dict, key: bytes) -> str:
    return hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()


def verify_export(
    root: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> dict:
    """Open (hash/platform/shape/pairing checks), restore the checkpoint, compare weights bitwise and
    every endpoint's outputs.

    Returns ``{"rows": [...], "passed": bool, ...}`` and records it in ``root/verification.json``
    with the sha256 of every file checked (and an HMAC over the record when given ``key``).
    """
    art = open_artifacts(root)
    rows, restored = _check_against_checkpoint(art, run_dir)
    result = {
        "manifest_sha256": art.manifest_sha256,
        "files_sha256": art.file_sha256,
        "platform": current_platform(),
        "checkpoint_step": restored.step,
        "checkpoint_manifest_sha256": restored.checkpoint_digest,
        "weights_compared": "bitwise, every tensor",
        "passed": all(r["passed"] for r in rows),
        "rows": rows,
        **_versions(),
    }
    if key is not None:
        result["hmac_sha256"] = _sign(result, key)
    atomic_write_json(art.root / VERIFICATION, result)
    return result


def require_verified(art: ArtifactSet, key: bytes | None = None) -> dict:
    """The verification record for exactly these files on this platform, all rows passed (and signed
    with ``key`` when one is given); else raise."""
    path = art.root / VERIFICATION
    if not path.is_file():
        _fail(art.root, f"not verified (run: tpulab verify-export {art.root})")
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        _fail(art.root, f"{VERIFICATION} is not valid JSON (run: tpulab verify-export {art.root})")
    if key is not None:
        mac = record.get("hmac_sha256")
        if not isinstance(mac, str):
            _fail(
                art.root,
                f"{VERIFICATION} is not signed (run: tpulab verify-export {art.root} --key-file KEY)",
            )
        try:
            good = hmac.compare_digest(mac, _sign(record, key))
        except ValueError:  # a NaN somewhere makes the record unserializable: not what we signed
            good = False
        if not good:
            _fail(
                art.root,
                f"{VERIFICATION} signature does not match the key (forged or signed with another key)",
            )
    if record.get("manifest_sha256") != art.manifest_sha256:
        _fail(
            art.root,
            f"{VERIFICATION} is for another manifest (run: tpulab verify-export {art.root})",
        )
    files = record.get("files_sha256")
    if not isinstance(files, dict) or files != art.file_sha256:
        bad = sorted(
            f
            for f in art.file_sha256
            if not isinstance(files, dict) or files.get(f) != art.file_sha256[f]
        )
        _fail(
            art.root,
            f"{VERIFICATION} does not record these files' sha256 "
            f"({', '.join(bad[:3]) or 'file list differs'}; run: tpulab verify-export {art.root})",
        )
    if record.get("platform") != current_platform():
        _fail(art.root, f"verified on {record.get('platform')}, not on {current_platform()}")
    if record.get("passed") is not True:
        _fail(art.root, "verification failed; see verification.json")
    return record


def load_verified(
    root: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> ArtifactSet:
    """What ``serve`` and ``generate`` run: an artifact set whose every file was rehashed just now and
    either re-verified against the checkpoint in ``run_dir`` (weights bitwise, outputs compared) or
    matched against a passing verification record (signed with ``key`` when given). Every artifact
    is deserialized and shape-checked first. ``art.verification`` says which of these happened."""
    art = open_artifacts(root)
    if run_dir is not None:
        rows, restored = _check_against_checkpoint(art, run_dir)
        failed = [r["artifact"] for r in rows if not r["passed"]]
        if failed:
            _fail(
                art.root,
                f"outputs differ from checkpoint step {restored.step}: {', '.join(failed)}",
            )
        art.verification = {
            "mode": "checkpoint",
            "run_dir": str(Path(run_dir).resolve()),
            "checkpoint_step": restored.step,
            "checkpoint_manifest_sha256": restored.checkpoint_digest,
            "weights": "bitwise equal to the checkpoint",
            "endpoints_passed": len(rows),
        }
    else:
        record = require_verified(art, key)
        art.verification = {
            "mode": "record+hmac" if key is not None else "record",
            "record": VERIFICATION,
            "files_rehashed": len(art.file_sha256),
            "signed": "hmac_sha256" in record,
            "signature_checked": key is not None,
        }
    return art


def verification_table(result: dict) -> str:
    lines = [
        "| artifact | platform | bitwise | max abs diff | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['artifact']} | {r['platform']} | {'yes' if r['bitwise'] else 'no'} | "
            f"{r['max_abs_diff']:.3g} | {r['tolerance']} | {'PASS' if r['passed'] else 'FAIL'} |"
        )
    return "\n".join(lines)
