"""The post-training recipe is data and the objective kinds stay in their own modules: no string in
``src/`` outside ``train/objectives/`` and the registry names a registered kind (the recipe YAML
names them); the recipe's stages build from the config alone; what a checkpoint can be used for is
asked of its objective class (``produces``, the SFT class), never read off its kind's name."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from conftest import tiny_config
from tpulab.errors import ConfigError, TpulabError
from tpulab.orchestrate import recipe
from tpulab.train.registry import objective_class, registered

SRC = Path(__file__).resolve().parents[1] / "src" / "tpulab"
# where a kind may be named: its own module, and the registry (its default kind)
OWNERS = (SRC / "train" / "objectives", SRC / "train" / "registry.py")


def kind_strings(source: str, kinds: set[str]) -> list[int]:
    """Lines of ``source`` holding a string constant that is exactly a kind's name."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds
    )


def test_no_kind_is_named_in_src_outside_its_module_and_the_registry():
    kinds = set(registered())
    assert {"pretrain", "sft", "reward", "dpo", "ppo", "ppo_env"} <= kinds
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if not any(path == o or o in path.parents for o in OWNERS)
        for line in kind_strings(path.read_text(), kinds)
    ]
    assert found == []
    # negative control: a type test on a kind's name, a key and an f-string's key are each found
    bad = 'if kind == "reward":\n    x = runs["dpo"]\ny = f"{w[\'ppo\']}"\n'
    assert kind_strings(bad, kinds) == [1, 2, 3]


def test_the_recipe_names_registered_kinds_and_fills_every_placeholder(tmp_path):
    from tpulab.orchestrate.capstone import posttrain_configs
    from tpulab.orchestrate.chain import DEMO, chain_configs

    start = tiny_config("objective.lora.alpha=4")
    tuned = posttrain_configs(start, tmp_path / "base")
    assert list(tuned) == list(recipe.finetune())
    source = tuned[recipe.chain()["source"]]
    assert source.objective.kind == recipe.source_kind()
    assert source.objective.init == str((tmp_path / "base").absolute())
    # a stage's lora is laid over the start's: the rank changes, the alpha stays
    assert [c.objective.lora.rank for c in tuned.values()] == [0, 8]
    assert {c.objective.lora.alpha for c in tuned.values()} == {4.0}
    reward = tmp_path / "scorer"
    stages = chain_configs(source, tmp_path / "sft", tmp_path / "pairs", reward, DEMO)
    assert list(stages) == list(recipe.chain()["stages"])
    for name, cfg in stages.items():
        assert objective_class(cfg.objective.kind).kind == cfg.objective.kind, name
        assert cfg.objective.init == str((tmp_path / "sft").absolute())
    assert str(reward.absolute()) in {c.objective.reward_model for c in stages.values()}
    # negative control: a placeholder nothing fills is one line, not a silent string
    with pytest.raises(ConfigError, match=r"the recipe names \$nope, which nothing fills"):
        recipe.fill({"objective": {"init": ["$nope"]}}, {"base": "x"})
    assert recipe.fill({"a": ["$base", "base"]}, {"base": 1}) == {"a": [1, "base"]}


def restored(*sets: str):
    return types.SimpleNamespace(config=tiny_config(*sets), checkpoint_dir=Path("."))


def test_a_reward_model_is_no_policy_by_what_its_objective_produces(monkeypatch):
    from tpulab.posttrain import pairs

    reward = restored("objective.kind=reward", "objective.init=x", "objective.data=y")
    monkeypatch.setattr(pairs, "load_model", lambda run_dir: reward)
    with pytest.raises(TpulabError, match="run is a reward model, not a policy: it cannot"):
        pairs.load_policy("run")
    policy = restored("objective.kind=sft", "objective.init=x")  # control: a policy passes
    monkeypatch.setattr(pairs, "load_model", lambda run_dir: policy)
    assert pairs.load_policy("run") is policy


def test_sft_eval_takes_an_sft_run_by_its_objective_class(monkeypatch):
    import tpulab.train.restore
    from tpulab.posttrain import evaluate

    monkeypatch.setattr(evaluate, "read_meta", lambda step_dir: {"identities": {"base": "b"}})
    for sets, ok in ((("objective.kind=sft", "objective.init=x"), True), ((), False)):
        run = restored(*sets)
        monkeypatch.setattr(tpulab.train.restore, "load_model", lambda run_dir, r=run: r)
        if ok:
            assert evaluate._verified(Path("run")) == (run, {"base": "b"})
        else:
            with pytest.raises(TpulabError, match="run is a pretrain run, not sft"):
                evaluate._verified(Path("run"))
