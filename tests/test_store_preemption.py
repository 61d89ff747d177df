"""Orbax never reads JAX's preemption sync point behind the trainer's back (store._Manager).

In a multi-process job the trainer's AgreedPreemption is the one reader of the sync-point counter;
Orbax's CheckpointManager reads it too on every save (with the step number), which can move the
agreed stop to a value no process reads again. Here the JAX function is replaced by a recorder:
Orbax's plain manager calls it on save (the negative control), the store's manager never does.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from tpulab.checkpoint.store import CheckpointStore, _Manager


def _save(manager_cls, directory) -> None:
    manager = manager_cls(
        directory,
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=True),
    )
    try:
        manager.save(7, args=ocp.args.StandardSave({"x": np.arange(3)}))
        manager.wait_until_finished()
    finally:
        manager.close()


def test_orbax_saves_do_not_read_the_preemption_sync_point(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda step: calls.append(step) or False
    )
    _save(ocp.CheckpointManager, tmp_path / "plain")
    assert 7 in calls  # negative control: Orbax's own manager reads it, with the step number
    calls.clear()
    _save(_Manager, tmp_path / "store")
    assert calls == [] and (tmp_path / "store" / "7").is_dir()
    store = CheckpointStore(tmp_path / "ckpt", keep=1, async_save=False)
    try:
        assert isinstance(store.manager, _Manager)
    finally:
        store.close()
