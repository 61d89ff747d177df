import dataclasses
from pathlib import Path

import pytest

from conftest import REPO, tiny_config
from tpulab.config import identity_diff, load, to_dict
from tpulab.errors import ConfigError
from tpulab.train.config import RunConfig


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    cfg = load(RunConfig, path)
    assert cfg.data.seq_len <= cfg.model.max_seq_len


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=64", "unknown config key 'model.d_modle'"),
    ("optim.lr=-1", "optim.lr=-1.0 must be positive"),
    ("data.seq_len=64", "data.seq_len=64 exceeds model.max_seq_len=32"),
    ("model.n_heads=3", "not divisible by model.n_heads=3"),
    ("model.n_layers=two", "must be an integer"),
    ("precision.compute_dtype=float16", "must be one of"),
    ("checkpoint.keep=1", "checkpoint.keep=1 must be >= 2"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        tiny_config(override)


def test_overrides_apply_after_file_and_types_are_checked():
    cfg = tiny_config("model.d_model=64", "optim.lr=1e-3", "data.path=null")
    assert cfg.model.d_model == 64 and cfg.optim.lr == 1e-3 and cfg.data.path is None
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg.optim.lr, float)


def test_identity_ignores_step_count_logging_and_checkpoint_cadence():
    a = to_dict(tiny_config())
    b = to_dict(tiny_config("train.steps=999", "train.log_every=1", "checkpoint.save_every=3", "data.path=/x"))
    assert identity_diff(RunConfig, a, b) == []
    c = to_dict(tiny_config("optim.lr=0.01", "seed=5"))
    assert sorted(d.split(":")[0] for d in identity_diff(RunConfig, a, c)) == ["optim.lr", "seed"]
