"""The LoRA run's model and state template, shared by the SFT objective and read-only restores.

A LoRA run's ``TrainState.params`` are the adapters alone (their optimizer state too); the base it
adapts is frozen and lives in the run it started from (``objective.init``), named by that
checkpoint's manifest digest in every checkpoint of the LoRA run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from tpulab.model import lora
from tpulab.train import sharding
from tpulab.train.config import RunConfig
from tpulab.train.step import TrainState, initial_state, optimizer


@dataclasses.dataclass(frozen=True)
class LoraGraph:
    graphdef: Any  # the adapted Transformer, split as (adapters, base)
    adapted: lora.Adapted
    config: RunConfig

    def init_adapters(self):
        """The adapters' starting values (A random, B zero), built inside the caller's program."""
        model, _ = lora.build(*self._args())
        return nnx.split(model, nnx.LoRAParam, nnx.Param)[1]

    def abstract_state(self, mesh) -> TrainState:
        """Shapes and shardings of a LoRA run's TrainState on ``mesh`` (the restore target)."""
        tx = optimizer(self.config.optim)
        shapes = jax.eval_shape(lambda: initial_state(tx, self.init_adapters(), self.config.seed))
        return sharding.placed_shapes(shapes, mesh)

    def _args(self):
        c = self.config
        lo = c.objective.lora
        return c.model, c.precision, lo.rank, lo.alpha, lo.targets, c.seed


def lora_graph(config: RunConfig) -> LoraGraph:
    """The adapted model's structure (nothing computed); an unmatched target is a ConfigError."""
    lo = config.objective.lora
    holder = {}

    def build():
        model, holder["adapted"] = lora.build(
            config.model, config.precision, lo.rank, lo.alpha, lo.targets, config.seed
        )
        return model

    graphdef, _, _ = nnx.split(nnx.eval_shape(build), nnx.LoRAParam, nnx.Param)
    return LoraGraph(graphdef, holder["adapted"], config)
