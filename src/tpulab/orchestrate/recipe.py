"""The post-training recipe: the committed data the capstone's post-training stage and the
preference chain (``orchestrate.chain``) run.

``recipes/posttrain.yaml`` (package data) names the stages, the objective kind each trains and
the settings it trains with, laid over the run config it starts from; this module reads it, fills
its ``$name`` placeholders (run dirs, sizes) and builds each stage's ``RunConfig``. The
orchestrator holds the mechanics (child processes, proofs, evaluation, reports) and no kind.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any

import yaml

from tpulab.config import from_dict, to_dict
from tpulab.errors import ConfigError
from tpulab.proofs.driver import run_to_completion
from tpulab.proofs.transformer import train_child_argv, write_child_config
from tpulab.train.config import RunConfig

RECIPE = "posttrain.yaml"  # in tpulab/orchestrate/recipes/


@functools.cache
def recipe() -> dict:
    """The committed recipe, parsed once (read only: callers fill copies)."""
    text = (importlib.resources.files("tpulab.orchestrate") / "recipes" / RECIPE).read_text()
    return yaml.safe_load(text)


def finetune() -> dict[str, dict]:
    """The capstone's fine-tuning stages, in order: name -> ``{title, config}``."""
    return recipe()["finetune"]


def chain() -> dict:
    """The preference chain: its ``source`` stage, the roles of its stages and the stages."""
    return recipe()["chain"]


def source_kind() -> str:
    """The objective kind the chain starts from: its source stage's."""
    return finetune()[chain()["source"]]["config"]["objective"]["kind"]


def fill(template: Any, values: dict[str, Any]) -> Any:
    """``template`` with every string ``$name`` replaced by ``values[name]``."""
    if isinstance(template, dict):
        return {k: fill(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [fill(v, values) for v in template]
    if isinstance(template, str) and template.startswith("$"):
        if template[1:] not in values:
            raise ConfigError(f"the recipe names {template}, which nothing fills")
        return values[template[1:]]
    return template


def stage_config(start: RunConfig, stage: dict, values: dict[str, Any]) -> RunConfig:
    """The run config of ``stage`` (a recipe stage: ``{title, config}``) over ``start``: its
    ``objective`` section replaces the start's (a section in it that the start's has too, such as
    ``lora``, laid over that one), every other section's keys are set; ``$name`` placeholders
    filled from ``values``."""
    d, overlay = to_dict(start), fill(stage["config"], values)
    objective = overlay.pop("objective")
    d["objective"] = {
        key: {**d["objective"][key], **value}
        if isinstance(d["objective"].get(key), dict) and isinstance(value, dict)
        else value
        for key, value in objective.items()
    }
    for section, settings in overlay.items():
        d[section].update(settings)
    return from_dict(RunConfig, d)


def train_stage(
    name: str, config: RunConfig, where: Path, compile_cache: Path | None, env: dict | None
) -> Path:
    """Stage ``name`` trained as a `tpulab train` child into ``where/name`` (its config written to
    ``where/name.yaml``, its output to ``where/name.log``; ``env`` added to its environment);
    raises TpulabError when it fails. Returns the run dir."""
    run_dir = Path(where) / name
    path = write_child_config(config, Path(where) / f"{name}.yaml")
    argv = train_child_argv(path, run_dir, compile_cache=compile_cache)
    environ = {**os.environ, **(env or {})}
    run_to_completion(argv, Path(where) / f"{name}.log", environ, 1800, f"{name} run")
    return run_dir
