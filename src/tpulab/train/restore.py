"""Load a trained model from a run dir's newest valid checkpoint (for checks, inference, export)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpulab.checkpoint.store import CheckpointStore
from tpulab.config import from_dict
from tpulab.errors import CheckpointError, TpulabError
from tpulab.model.transformer import Transformer
from tpulab.train.config import RunConfig
from tpulab.train.step import make_steps


@dataclasses.dataclass(frozen=True)
class Restored:
    model: Transformer
    config: RunConfig
    step: int
    checkpoint_dir: Path
    checkpoint_digest: str  # sha256 of the checkpoint's manifest: names these exact weights


def load_model(run_dir: str | Path, step: int | None = None) -> Restored:
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise TpulabError(f"{run_dir} holds no checkpoints (train first: tpulab train --run-dir {run_dir})")
    store = CheckpointStore(ckpt_dir, keep=1_000_000, async_save=False)
    try:
        step = store.latest if step is None else step
        if step is None:
            raise CheckpointError(f"{ckpt_dir} holds no valid checkpoint")
        if not store.step_dir(step).is_dir():
            raise CheckpointError(f"{ckpt_dir} has no checkpoint at step {step}")
        config = from_dict(RunConfig, store.read_meta(step)["config"])
        steps = make_steps(config)
        state = store.restore(step, steps.abstract_state(), None)
        return Restored(steps.model(state.params), config, step, store.step_dir(step), store.digest(step))
    finally:
        store.close()
