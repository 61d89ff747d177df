"""Whole-state verdicts: two runs' final checkpoints compared leaf by leaf, bitwise.

Equal loss curves can hide a different state (a dropout key nobody used yet, an Adam moment that
has not shown up in the loss). This compares everything a checkpoint holds: every leaf of its
state (``TrainState``: the step, parameters, both Adam moments and the count, the dropout key;
PPO's ``PPOState`` adds the round in progress) and the Grain data position (the ``data`` item's
files), with each run's newest verified checkpoint restored read-only. The verdict's list of what
was compared is read from the state compared (``compared``), so a new field is named with no edit
here. A checkpoint without a data position is refused (two empty positions would hash alike and
compare equal) unless its meta says it has none (``data_position: false``: an objective whose state
carries its own data, a ``DataSource`` with no training iterator); then the state is all there is
to compare, and both checkpoints must say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from tpulab.checkpoint.compare import compare_trees
from tpulab.checkpoint.files import sha256_file
from tpulab.checkpoint.store import read_meta
from tpulab.errors import CheckpointError
from tpulab.train.restore import load_model

DATA_POSITION = "data position (Grain iterator state)"
FIELD_NAMES = {"params": "parameters", "rng": "RNG key"}  # the rest are named as they are


def optimizer_fields(tree: Any) -> set[str]:
    """The fields holding arrays of an optax state's NamedTuples (Adam: count, mu, nu), through
    chains and inner states; what a field holds (mu's parameter tree) is not walked."""
    out: set[str] = set()
    if hasattr(tree, "_fields"):
        for f in tree._fields:
            v = getattr(tree, f)
            if isinstance(v, tuple):  # an inner state (a chain's, MaskedState.inner_state)
                out |= optimizer_fields(v)
            elif jax.tree.leaves(v):
                out.add(f)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            out |= optimizer_fields(v)
    return out


def compared(state: Any, data_position: bool = True) -> str:
    """What a verdict over ``state`` (a NamedTuple of the loop: ``TrainState``, ``PPOState``)
    compares, named from its fields: the optimizer state by the names of its leaves' fields (Adam:
    count, mu, nu), a nested NamedTuple (PPO's round) by its own fields."""
    parts = []
    for name in state._fields:
        value = getattr(state, name)
        if name == "opt_state":
            attrs = optimizer_fields(value)
            parts.append(f"optimizer state ({', '.join(sorted(attrs))})" if attrs else name)
        elif hasattr(value, "_fields"):
            parts.append(f"{name} ({', '.join(value._fields)})")
        else:
            parts.append(FIELD_NAMES.get(name, name))
    return ", ".join([*parts, *(["Grain data position"] if data_position else [])])


def data_position(step_dir: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint's Grain iterator state (one per process). Orbax's
    commit_success.txt names the directory it was written to, not the state, so it is left out.
    Raises when there is no state file, or one is empty; ``{}`` for a checkpoint whose meta says
    it saved none (and that holds none)."""
    root = Path(step_dir) / "data"
    if read_meta(step_dir).get("data_position") is False:
        if root.exists():
            raise CheckpointError(f"checkpoint {step_dir} says it saved no data position: {root}")
        return {}
    files = (
        sorted(p for p in root.rglob("*") if p.is_file() and p.name != "commit_success.txt")
        if root.is_dir()
        else []
    )
    if not files:
        raise CheckpointError(f"checkpoint {step_dir} holds no Grain data position ({root})")
    empty = [p for p in files if p.stat().st_size == 0]
    if empty:
        raise CheckpointError(f"checkpoint {step_dir} has an empty Grain data position: {empty[0]}")
    return {str(p.relative_to(root)): sha256_file(p) for p in files}


def final_state_verdict(reference_dir: Path, run_dir: Path) -> dict:
    ref, run = load_model(reference_dir), load_model(run_dir)
    if ref.step != run.step:
        raise CheckpointError(
            f"final checkpoints are at different steps: {ref.step} ({reference_dir}) vs "
            f"{run.step} ({run_dir})"
        )
    n, first = compare_trees(jax.device_get(ref.state), jax.device_get(run.state))
    ref_pos, run_pos = data_position(ref.checkpoint_dir), data_position(run.checkpoint_dir)
    if bool(ref_pos) != bool(run_pos):
        raise CheckpointError(
            f"one final checkpoint holds a data position and the other none: {len(ref_pos)} "
            f"file(s) ({reference_dir}) vs {len(run_pos)} ({run_dir})"
        )
    if first is None and ref_pos != run_pos:
        differ = sorted(k for k in set(ref_pos) | set(run_pos) if ref_pos.get(k) != run_pos.get(k))
        first = f"{DATA_POSITION}: {differ[0]}"
    return {
        "final_state_identical": first is None,
        "first_differing_leaf": first,
        "leaves_compared": n,
        "data_position_files": len(run_pos),
        "final_state_step": run.step,
        "final_state_compared": compared(run.state, bool(run_pos)),
    }
