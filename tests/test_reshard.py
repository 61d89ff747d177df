"""reshard's bitwise_equal is a comparison of what it wrote: the new checkpoint is read back and
compared with the source, and a store that writes something else is caught and named."""

from __future__ import annotations

import jax
import pytest

from tpulab.errors import CheckpointError
from tpulab.train import reshard as R
from tpulab.train.config import MeshConfig


def test_reshard_reads_its_checkpoint_back(trained_run, tmp_path):
    out = R.reshard(trained_run, tmp_path / "out", MeshConfig())
    assert out["bitwise_equal"] is True and out["leaves_read_back"] == out["leaves"] == 46
    assert (tmp_path / "out" / "checkpoints" / "40" / "tpulab_manifest.json").exists()


@pytest.mark.parametrize("what", ["state", "position"])
def test_a_store_that_writes_something_else_is_caught(trained_run, tmp_path, monkeypatch, what):
    """Negative control: the store is handed the right state but writes the dropout key with one
    bit flipped (or the data iterator one batch further on); the read-back must name it, and the
    bad checkpoint must not be left to resume from."""

    class Skewed(R.CheckpointStore):
        def save(self, step, state, data_iter, meta):
            if what == "state":
                state = state._replace(rng=jax.numpy.bitwise_xor(state.rng, 1))
            else:
                next(data_iter)
            super().save(step, state, data_iter, meta)

    monkeypatch.setattr(R, "CheckpointStore", Skewed)
    leaf = "rng" if what == "state" else "data position"
    with pytest.raises(CheckpointError, match=f"read back .* differs .* at .*{leaf}"):
        R.reshard(trained_run, tmp_path / "out", MeshConfig())
    assert not (tmp_path / "out" / "checkpoints" / "40").exists()
