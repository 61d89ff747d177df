"""An opened artifact set against the checkpoint it came from: every weight tensor bitwise, and
every endpoint's outputs against the jitted model, one row per artifact.

Tolerances: fp32 must be bitwise (same computation, same compiler); bf16/int8 get a small stated
margin for lowering differences in their casts/rounding (in practice bitwise too; the table shows
it). The loop must give the same tokens on a ragged batch of two (one greedy, one sampled row).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.evidence.report_kit import table
from tpulab.inference.artifact_format import (
    LOOP,
    WEIGHTS,
    artifact_name,
    check_inputs,
    current_platform,
    refuse,
)
from tpulab.inference.artifacts import ArtifactSet
from tpulab.model import kvcache as kv
from tpulab.model.decode import Decoder, ModelFns, pad_prompt

if TYPE_CHECKING:
    from tpulab.train.restore import Restored

# Max |difference| allowed between an endpoint and the jitted model on this platform (see above).
TOLERANCE = {"fp32": 0.0, "bf16": 1e-3, "int8": 1e-3}
VERIFY_PROMPT = "ROMEO:\nBut soft, what light"


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
    """Every tensor of weights.npz bitwise equal to the checkpoint's (names, dtypes, shapes,
    bytes)."""
    names = set(art.params)
    if names != set(params):
        refuse(
            art.root,
            f"{WEIGHTS} and checkpoint step {step} hold different tensors: "
            f"{sorted(names ^ set(params))[:3]}",
        )
    for n in sorted(names):
        a, b = np.asarray(art.params[n]), np.asarray(params[n])
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            refuse(
                art.root,
                f"{WEIGHTS}: tensor {n} differs from checkpoint step {step} "
                "(forged or foreign weights)",
            )


def _loop_compare(art: ArtifactSet, fns: ModelFns, policy: str) -> dict:
    """The exported loop against the jitted loop on a ragged batch of two (one greedy row, one
    sampled)."""
    from tpulab.inference.generate import Request, batch_arrays
    from tpulab.model.sampling import SamplingConfig

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


def check_against_checkpoint(art: ArtifactSet, run_dir: str | Path) -> tuple[list[dict], Restored]:
    """Restore the manifest's checkpoint step from ``run_dir`` (its manifest verified; its digest
    must be the one the artifacts were exported from), compare weights bitwise and every
    endpoint's outputs. Pairing problems raise; numeric mismatches are failed rows."""
    from tpulab.inference.generate import prompt_ids
    from tpulab.train.restore import load_model

    src = art.manifest["source"]
    restored = load_model(run_dir, src["checkpoint_step"])
    if restored.checkpoint_digest != src["checkpoint_manifest_sha256"]:
        refuse(
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


def verification_table(result: dict) -> str:
    return table(
        ["artifact", "platform", "bitwise", "max abs diff", "tolerance", "result"],
        [
            (
                r["artifact"],
                r["platform"],
                "yes" if r["bitwise"] else "no",
                f"{r['max_abs_diff']:.3g}",
                r["tolerance"],
                "PASS" if r["passed"] else "FAIL",
            )
            for r in result["rows"]
        ],
    )
