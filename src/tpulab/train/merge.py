"""``tpulab merge-lora``: fold a LoRA run's adapters into its base and write a plain model.

The output is a run dir holding one checkpoint of a plain Transformer (``W + (alpha / r) A B`` for
every adapted projection, in float32) that ``generate``, ``export`` and ``verify-export`` read like
any other. It is a model, not a training state: it has no optimizer state and no data position
(``model_only`` in its metadata), so training refuses to resume it; a new run may start from it
(``objective.init``). ``merge.json`` records where it came from and how far the merged logits are
from the adapter model's on held-out prompts.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.checkpoint.files import atomic_write_json, check_out, manifest_digest
from tpulab.checkpoint.rundir import RunDir, read_json
from tpulab.checkpoint.store import CheckpointStore, read_meta, scan
from tpulab.config import to_dict
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import TpulabError
from tpulab.model import lora
from tpulab.train.config import LoraConfig
from tpulab.train.restore import checkpoint_dir, load_model
from tpulab.train.step import TrainState, merge_model, transformer_graph

# Merged against adapter logits, relative to the largest |logit|: fp32 rounding of one extra add
# per adapted matmul; measured ~1e-7 at the tiny and default sizes.
MERGE_BOUND = 1e-5
MERGE_RECORD = "merge.json"


def merge_lora(run_dir: str | Path, out: str | Path, probe: np.ndarray | None = None) -> dict:
    """Write ``out`` (a run dir with the merged model); returns the merge record. A non-empty
    ``out`` is refused before anything is read, unless it is an intact earlier merge of the same
    adapters: then its record is returned (``"reused": true``) and nothing is written."""
    adapters = manifest_digest(checkpoint_dir(run_dir))
    out = check_out(out, reuse=lambda d: _same_merge(d, adapters) is not None)
    earlier = _same_merge(out, adapters) if out.is_dir() else None
    if earlier is not None:
        return {**earlier, "reused": True}
    src = load_model(run_dir)
    if src.base is None:
        raise TpulabError(
            f"{run_dir} is not a LoRA run (objective.lora.rank is 0): nothing to merge"
        )
    t0 = time.perf_counter()
    merged = jax.block_until_ready(folded(src.model))
    merge_s = time.perf_counter() - t0
    config = dataclasses.replace(
        src.config, objective=dataclasses.replace(src.config.objective, lora=LoraConfig())
    )
    graphdef, _ = transformer_graph(config)
    tokens = probe if probe is not None else default_probe(config.data.seq_len)
    a = np.asarray(src.model(jnp.asarray(tokens), deterministic=True))
    b = np.asarray(merge_model(graphdef, merged)(jnp.asarray(tokens), deterministic=True))
    rel = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
    if not rel <= MERGE_BOUND:
        raise TpulabError(
            f"merged logits differ from the adapter model's by {rel:.3g} (relative), over the "
            f"{MERGE_BOUND:g} bound; nothing written"
        )
    meta = {
        "corpus_identity": _meta(src).get("corpus_identity"),
        "identities": {**_meta(src).get("identities", {}), "merged_from": src.checkpoint_digest},
    }
    digest = write_model_run(
        out, config, src.step, TrainState(src.state.step, merged, (), src.state.rng), meta
    )
    record = {
        "source_run_dir": str(run_dir),
        "source_checkpoint_digest": src.checkpoint_digest,
        "base_checkpoint_digest": src.base.checkpoint_digest,
        "merged_checkpoint_digest": digest,
        "step": src.step,
        "adapted_matrices": sum(1 for d in lora.projections(src.model).values() if d.lora),
        "merge_seconds": merge_s,
        "probe_shape": list(tokens.shape),
        "max_relative_logit_diff": rel,
        "bound": MERGE_BOUND,
    }
    atomic_write_json(out / MERGE_RECORD, record)
    return record


def write_model_run(out: Path, config, step: int, state: TrainState, meta: dict) -> str:
    """``out`` (absent or empty) as a run dir holding one model-only checkpoint ``step`` of
    ``state`` (no optimizer state, no data position: ``model_only`` in its metadata) with ``meta``
    beside the config and tokenizer; returns the checkpoint's digest. ``load_model`` reads and
    verifies it like any other; training refuses to resume it. Shared by merge-lora and
    ``tpulab convert``."""
    run = RunDir(out)
    out.mkdir(parents=True, exist_ok=True)
    run.write_config(config)
    meta = {"config": to_dict(config), "tokenizer": TOKENIZER, **meta, "model_only": True}
    store = CheckpointStore(run.checkpoints, keep=2, async_save=False)
    try:
        store.save(step, state, None, meta)
        store.wait()
        return store.digest(step)
    finally:
        store.close()


def folded(model) -> nnx.State:
    """``lora.merged_params`` as one compiled program, bitwise the same result. Eagerly, each of
    its ops compiles on first use: 1.82 s for a d_model 512 model (16 adapted matrices) at load 10
    on 2 cores, against 1.11 s jitted at load ~20; warm, 0.03-0.2 s (docs/posttraining.md)."""
    graphdef, state = nnx.split(model)
    return _fold(graphdef, state)


@jax.jit
def _fold(graphdef, state) -> nnx.State:
    return lora.merged_params(nnx.merge(graphdef, state))


def default_probe(seq_len: int) -> np.ndarray:
    """Fixed byte sequences (seeded), for the merge's logit comparison."""
    return np.random.default_rng(0).integers(0, 256, size=(4, seq_len), dtype=np.int32)


def _same_merge(out: Path, adapters: str) -> dict | None:
    """``out``'s merge record if it merged the adapter checkpoint ``adapters`` and its merged
    checkpoint still verifies as the one the record names; else None."""
    try:
        record = read_json(out / MERGE_RECORD, None)
    except (OSError, ValueError):  # not a record merge-lora wrote: in the way
        return None
    if not isinstance(record, dict) or record.get("source_checkpoint_digest") != adapters:
        return None
    found = scan(RunDir(out).checkpoints) if RunDir(out).checkpoints.is_dir() else None
    if found is None or found.latest is None:
        return None
    held = manifest_digest(found.directory / str(found.latest))
    return record if held == record.get("merged_checkpoint_digest") else None


def _meta(r) -> dict:
    return read_meta(r.checkpoint_dir)
