"""Whole-state verdicts: two runs' final checkpoints compared leaf by leaf, bitwise.

Equal loss curves can hide a different state (a dropout key nobody used yet, an Adam moment that has
not shown up in the loss). This compares everything a checkpoint holds: parameters, both Adam moments
and the count, the step, the dropout key (``TrainState``) and the Grain data position (the ``data``
item's files), with each run's newest verified checkpoint restored read-only.
"""

from __future__ import annotations

from pathlib import Path

import jax

from tpulab.checkpoint.compare import compare_trees
from tpulab.checkpoint.files import sha256_file
from tpulab.errors import TpulabError
from tpulab.train.restore import load_model

COMPARED = "parameters, Adam moments (mu, nu) and count, step, dropout key, Grain data position"


def data_position(step_dir: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint's Grain iterator state (one per process). Orbax's
    commit_success.txt names the directory it was written to, not the state, so it is left out."""
    root = step_dir / "data"
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "commit_success.txt"
    }


def final_state_verdict(reference_dir: Path, run_dir: Path) -> dict:
    ref, run = load_model(reference_dir), load_model(run_dir)
    if ref.step != run.step:
        raise TpulabError(
            f"final checkpoints are at different steps: {ref.step} ({reference_dir}) vs "
            f"{run.step} ({run_dir})"
        )
    n, first = compare_trees(jax.device_get(ref.state), jax.device_get(run.state))
    data_same = data_position(ref.checkpoint_dir) == data_position(run.checkpoint_dir)
    if first is None and not data_same:
        first = "data position (Grain iterator state)"
    return {
        "final_state_identical": first is None,
        "first_differing_leaf": first,
        "leaves_compared": n,
        "final_state_step": run.step,
        "final_state_compared": COMPARED,
    }
