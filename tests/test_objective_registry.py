"""The objective registry and the per-kind config sections, from the config alone (nothing trains):
a kind by name or import path, each kind's own section spelled ``objective.<kind>.<field>``, a
section of another kind refused naming its owner, old run configs (every kind's defaults) still
read, and the identity diff that decides a resume."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_config
from tpulab.config import from_dict, identity_diff, load, to_dict
from tpulab.errors import ConfigError
from tpulab.train.config import RunConfig
from tpulab.train.objective import Objective
from tpulab.train.registry import objective_class, register_objective, registered


def test_the_built_ins_register_and_an_import_path_resolves():
    kinds = registered()
    assert {"pretrain", "sft", "reward", "dpo", "ppo"} <= kinds.keys()
    assert objective_class("tpulab.train.objectives.dpo:DPO") is kinds["dpo"]
    for bad, why in (
        ("nope", r"is not registered \(registered: "),
        ("os:path", "path in os is not an Objective"),
        ("no_such_module:X", "cannot import no_such_module"),
    ):
        with pytest.raises(ConfigError, match=why):
            objective_class(bad)


def test_registration_refuses_what_is_not_an_objective_and_a_second_class_under_a_kind():
    with pytest.raises(ConfigError, match="not a subclass of tpulab.Objective"):
        register_objective(dict)

    class Impostor(Objective):
        kind = "dpo"

    with pytest.raises(ConfigError, match="'dpo' is registered twice"):
        register_objective(Impostor)
    assert registered()["dpo"] is not Impostor  # the refusal left the registry as it was

    class Dotted(Objective):
        kind = "a.b"

    with pytest.raises(ConfigError, match="must be a plain name"):
        register_objective(Dotted)


def test_a_kind_reads_its_own_section_by_its_name_in_yaml_and_code():
    cfg = tiny_config("objective.kind=dpo", "objective.init=x", "objective.dpo.beta=0.3")
    assert cfg.objective.options.beta == 0.3 and cfg.objective.dpo is cfg.objective.options
    with pytest.raises(AttributeError, match="no section 'ppo'"):
        cfg.objective.ppo  # noqa: B018
    saved = to_dict(cfg)
    assert saved["objective"]["dpo"]["beta"] == 0.3 and "options" not in saved["objective"]
    assert "ppo" not in saved["objective"]  # only the kind's own section is written
    assert load(RunConfig, base=saved) == cfg  # what a child reads back is the same run


def test_another_kinds_section_is_refused_naming_its_owner_unless_it_holds_defaults():
    old = to_dict(tiny_config())
    # a run config written before sections were per kind holds every kind's defaults: still read
    old["objective"].update(
        {name: to_dict(cls()) for name, cls in ((k, c.Config) for k, c in registered().items())}
    )
    assert from_dict(RunConfig, old) == tiny_config()
    # negative control: the same with one of another kind's values changed is refused
    old["objective"]["dpo"]["beta"] = 0.5
    with pytest.raises(ConfigError, match="objective.dpo applies to objective.kind=dpo, not pre"):
        from_dict(RunConfig, old)
    with pytest.raises(ConfigError, match="unknown config key 'objective.options'"):
        tiny_config("objective.options.beta=1")


def test_the_shared_settings_follow_the_objectives_rules():
    with pytest.raises(ConfigError, match="objective.kind=sft needs objective.init: the run dir"):
        tiny_config("objective.kind=sft")
    with pytest.raises(ConfigError, match="objective.reward_model applies to objective.kind=ppo,"):
        tiny_config("objective.kind=dpo", "objective.init=x", "objective.reward_model=y")
    with pytest.raises(ConfigError, match="not reward: the reward model trains every parameter"):
        tiny_config("objective.kind=reward", "objective.init=x", "objective.lora.rank=4")


def test_the_identity_diff_reads_a_key_an_older_config_lacks_as_its_default():
    now = to_dict(tiny_config())
    older = to_dict(tiny_config())
    del older["model"]["family"]  # written before model families existed
    assert identity_diff(RunConfig, older, now) == []
    # negative controls: a changed family setting and a kind's own option are both diffs
    changed = to_dict(tiny_config("model.d_model=64", "model.n_heads=2"))
    assert identity_diff(RunConfig, now, changed) == ["model.d_model: 32 -> 64"]
    a = to_dict(tiny_config("objective.kind=dpo", "objective.init=x"))
    b = to_dict(tiny_config("objective.kind=dpo", "objective.init=x", "objective.dpo.beta=0.3"))
    assert identity_diff(RunConfig, a, b) == ["objective.dpo.beta: 0.1 -> 0.3"]


def test_model_family_is_the_transformer_unless_named():
    assert tiny_config().model.family == "transformer"
    assert dataclasses.replace(tiny_config().model, d_model=64).family == "transformer"
    with pytest.raises(ConfigError, match="model.family='mlp2' is not registered"):
        tiny_config("model.family=mlp2")


def test_the_default_kind_takes_nothing_so_a_plain_config_needs_no_objective_import():
    """What ``ObjectiveConfig``'s fast path assumes (config errors before jax is imported)."""
    from tpulab.train.objective import NoOptions
    from tpulab.train.registry import DEFAULT_KIND

    default = registered()[DEFAULT_KIND]
    assert default.Config is NoOptions and not default.uses and not default.needs
    # the fast path and the resolved path build the same config
    assert tiny_config() == from_dict(RunConfig, to_dict(tiny_config()))
    assert "pretrain" in to_dict(tiny_config())["objective"]  # written with its (empty) section
