"""The bridge's whole-state verdict: the final checkpoints of a straight run and a resumed one
compared bitwise (model, optimizer, step, generator states), and controls that change one part."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest
import torch

from tpulab.bridge import checkpoint as C
from tpulab.bridge.config import BridgeConfig
from tpulab.bridge.loop import train
from tpulab.checkpoint.files import write_manifest

CFG = dict(n=32, hidden=16, checkpoint_every=3, augment=0.1, dropout=0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 12-step torch run, and the same run stopped at 6 and resumed in a fresh ``train`` call."""
    root = tmp_path_factory.mktemp("bridge-state")
    train(BridgeConfig(steps=12, **CFG), "torch", "eager", root / "ref")
    train(BridgeConfig(steps=6, **CFG), "torch", "eager", root / "res")
    train(BridgeConfig(steps=12, **CFG), "torch", "eager", root / "res")
    return root / "ref", root / "res"


def _edit_final(run, tmp_path, edit):
    """A copy of ``run`` whose final checkpoint has ``edit`` applied (manifest rewritten)."""
    out = tmp_path / "edited"
    shutil.copytree(run, out)
    path = C.latest(out)
    state = C.load_state(path)
    edit(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    (path / "state.pt").write_bytes(buf.getvalue())
    write_manifest(path, extra={"step": state["step"]})
    return out


def test_a_resumed_run_ends_in_the_same_whole_state(runs):
    v = C.final_state_verdict(*runs)
    assert v["final_state_identical"] is True and v["first_differing_leaf"] is None
    assert v["final_state_step"] == 12 and v["leaves_compared"] > 10
    assert "rng (torch_cpu, augment)" in v["final_state_compared"]
    assert "optimizer" in v["final_state_compared"]


def _nudge_augment(state):
    g = state["rng"]["augment"].clone()
    g[-1] ^= 1  # one bit of the augmentation generator's state
    state["rng"]["augment"] = g


def _nudge_moment(state):
    m = state["optimizer"]["state"][0]["exp_avg_sq"]
    flat = m.numpy().reshape(-1).copy()
    flat[0] = np.nextafter(flat[0], np.float32(1))  # one ulp of one Adam second moment
    state["optimizer"]["state"][0]["exp_avg_sq"] = torch.from_numpy(flat.reshape(m.shape))


@pytest.mark.parametrize(
    "edit, leaf",
    [
        (_nudge_augment, "['rng']['augment']"),
        (_nudge_moment, "['optimizer']['state'][0]['exp_avg_sq']"),
        (lambda s: s.pop("rng"), "<tree structure> at ['rng']"),  # a generator state not saved
    ],
)
def test_a_changed_part_of_the_state_is_caught_and_named(runs, tmp_path, edit, leaf):
    ref, res = runs
    v = C.final_state_verdict(ref, _edit_final(res, tmp_path, edit))
    assert v["final_state_identical"] is False
    assert v["first_differing_leaf"].startswith(leaf), v["first_differing_leaf"]


def test_a_resume_without_generator_state_differs_in_the_model(tmp_path):
    """Both runs leave the generator states out (as the proof's negative control does): the
    resumed one redraws augmentation noise and dropout masks, so its weights differ."""
    train(BridgeConfig(steps=12, **CFG), "torch", "eager", tmp_path / "ref", restore_rng=False)
    for steps in (6, 12):
        cfg = BridgeConfig(steps=steps, **CFG)
        train(cfg, "torch", "eager", tmp_path / "res", restore_rng=False)
    v = C.final_state_verdict(tmp_path / "ref", tmp_path / "res")
    assert v["final_state_identical"] is False
    assert v["first_differing_leaf"].startswith("['model']"), v["first_differing_leaf"]
