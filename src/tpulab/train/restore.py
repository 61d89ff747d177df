"""Load a trained model or whole state from a run dir's newest valid checkpoint, read-only.

For checks, inference, export and the proofs' whole-state verdicts: nothing in the run dir is moved or
written (a refused step stays where it is; only training moves refused steps aside).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpulab.checkpoint.files import manifest_digest
from tpulab.checkpoint.store import read_meta, read_state, scan
from tpulab.config import from_dict
from tpulab.errors import CheckpointError, TpulabError
from tpulab.model.transformer import Transformer
from tpulab.train.config import RunConfig
from tpulab.train.step import TrainState, make_mesh, make_steps


@dataclasses.dataclass(frozen=True)
class Restored:
    model: Transformer
    config: RunConfig
    step: int
    checkpoint_dir: Path
    checkpoint_digest: str  # sha256 of the checkpoint's manifest: names these exact weights
    state: TrainState


def checkpoint_dir(run_dir: str | Path, step: int | None = None) -> Path:
    """The verified step dir (newest when ``step`` is None); one-line errors otherwise."""
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise TpulabError(
            f"{run_dir} holds no checkpoints (train first: tpulab train --run-dir {run_dir})"
        )
    found = scan(ckpt_dir)
    step = found.latest if step is None else step
    if step is None:
        raise CheckpointError(f"{ckpt_dir} holds no valid checkpoint")
    if not (ckpt_dir / str(step)).is_dir():
        raise CheckpointError(f"{ckpt_dir} has no checkpoint at step {step}")
    return ckpt_dir / str(step)


def load_model(run_dir: str | Path, step: int | None = None) -> Restored:
    step_dir = checkpoint_dir(run_dir, step)
    config = from_dict(RunConfig, read_meta(step_dir)["config"])
    steps = make_steps(
        config, make_mesh()
    )  # replicated on the devices here, whatever mesh trained it
    state = read_state(step_dir, steps.abstract_state())
    return Restored(
        steps.model(state.params),
        config,
        int(step_dir.name),
        step_dir,
        manifest_digest(step_dir),
        state,
    )
