"""``tpulab reshard``: move a run's newest checkpoint onto another mesh / process count, verified
bitwise.

The state is restored by Orbax straight into the new layout's shardings (the sharding table applied
to the new mesh), then gathered and compared byte for byte with a second, fully replicated restore
of the same checkpoint, so a resharding that moved or mixed up a shard is caught; after the save,
the new checkpoint is read back in the new layout and compared with that restore again (and its
data positions with the saved one), so ``bitwise_equal`` is a comparison of what was written. The
Grain position is the same in every process by construction (tpulab.data.pipeline: process p reads
blocks p, p+P, ... of one shuffled stream, ``next_index`` = steps taken), so it carries over to any
process count: the saved per-process positions are checked equal and set on the new processes'
iterators. The new run dir gets the config with the new mesh, and a checkpoint (same step,
manifest, topology) that ``tpulab train`` resumes from.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab.checkpoint.compare import compare_trees
from tpulab.checkpoint.files import check_out
from tpulab.checkpoint.rundir import RunDir, read_json, write_json
from tpulab.checkpoint.store import CheckpointStore, read_meta, read_state
from tpulab.config import from_dict, to_dict
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, train_dataset
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import CheckpointError, TpulabError
from tpulab.train.config import MeshConfig, RunConfig
from tpulab.train.registry import objective_class
from tpulab.train.restore import checkpoint_dir
from tpulab.train.sharding import make_mesh, topology


def _gathered(tree):
    from jax.experimental import multihost_utils

    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
    )


def data_positions(step_dir: Path) -> list[dict]:
    files = sorted((Path(step_dir) / "data").glob("process_*-of-*.json"))
    if not files:
        raise CheckpointError(f"{step_dir} holds no Grain data position")
    return [read_json(f) for f in files]


def read_back(
    step_dir: Path, abstract: Any, expected: Any, position: dict
) -> tuple[int, str | None]:
    """(leaves compared, first difference) of checkpoint ``step_dir`` restored into ``abstract``'s
    layout and gathered, against ``expected`` (host arrays), and of every process's saved data
    position against ``position``."""
    n, first = compare_trees(_gathered(read_state(step_dir, abstract)), expected)
    if first is None:
        saved = data_positions(step_dir)
        bad = [i for i, pos in enumerate(saved) if pos != position]
        if bad:
            first = f"data position (Grain iterator state) of process {bad[0]}"
    return n, first


def reshard(src_run: Path, dst_run: Path, mesh_cfg: MeshConfig, step: int | None = None) -> dict:
    """Reshard checkpoint ``step`` (default: the newest valid one) of ``src_run`` into the new run
    dir ``dst_run``."""
    step_dir = checkpoint_dir(src_run, step)
    # new or empty; under `tpulab launch` it already holds the launcher's own logs (launch/)
    dst_run = check_out(dst_run, reuse=lambda d: [p.name for p in d.iterdir()] == ["launch"])
    dst = RunDir(dst_run)
    meta = read_meta(step_dir)
    config = dataclasses.replace(from_dict(RunConfig, meta["config"]), mesh=mesh_cfg)
    mesh = make_mesh(mesh_cfg)  # an impossible layout fails here, before anything is written
    positions = data_positions(step_dir)
    if any(p != positions[0] for p in positions):
        raise CheckpointError(
            f"{step_dir}: the processes' data positions differ ({positions}); cannot reshard"
        )
    step = int(step_dir.name)

    abstract = objective_class(config.objective.kind).abstract_state(config, mesh)
    state = read_state(step_dir, abstract)
    replicated = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        abstract,
    )
    whole = _gathered(read_state(step_dir, replicated))
    n, first = compare_trees(_gathered(state), whole)
    if first is not None:
        raise CheckpointError(f"resharded leaf {first} differs from the saved one; nothing written")
    if int(_gathered(state.step)) != step:
        raise CheckpointError(
            f"checkpoint step {step} holds a state at step {int(_gathered(state.step))}"
        )

    splits = build_splits(load_corpus(config.data.path), config.data)
    if meta.get("corpus_identity") != splits.corpus.identity:
        raise TpulabError(
            f"the corpus at {config.data.path} is not the one {src_run} was trained on"
        )
    data_iter = iter(
        train_dataset(splits.train_windows, config.data, jax.process_index(), jax.process_count())
    )
    data_iter.set_state(positions[0])
    here = topology(mesh)
    new_meta = {
        "config": to_dict(config),
        "corpus_identity": splits.corpus.identity,
        "tokenizer": TOKENIZER,
        "topology": here,
        "resharded_from": {
            "run_dir": str(Path(src_run).absolute()),
            "step": step,
            "topology": meta.get("topology"),
        },
    }
    primary = jax.process_index() == 0
    if primary:
        dst_run.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(
        dst.checkpoints, keep=config.checkpoint.keep, async_save=False, primary=primary
    )
    try:
        store.save(step, state, data_iter, new_meta)
        store.wait()
    finally:
        store.close()
    # What was written, read back in the new layout, against the source's replicated restore: a
    # store that wrote anything else (a moved shard, a stale buffer, another position) is caught.
    n_back, differ = read_back(store.step_dir(step), abstract, whole, positions[0])
    if differ is not None:
        if primary:
            shutil.rmtree(store.step_dir(step), ignore_errors=True)
        raise CheckpointError(
            f"the resharded checkpoint read back from {dst_run} differs from {step_dir} at "
            f"{differ}; removed it"
        )
    result = {
        "step": step,
        "from": _describe(meta.get("topology")),
        "to": _describe(here),
        "leaves": n,
        "leaves_read_back": n_back,
        "bitwise_equal": differ is None,
        "out": str(dst_run),
        "source_checkpoint": str(step_dir),
    }
    if primary:
        dst.write_config(config)
        write_json(dst_run / "reshard.json", result)
    return result


def _describe(t: dict | None) -> str:
    if not t:
        return "an unrecorded topology"
    m = t["mesh"]
    return (
        f"{t['process_count']} proc x {t['device_count']} dev "
        f"{{data:{m['data']}, fsdp:{m['fsdp']}}}"
    )
