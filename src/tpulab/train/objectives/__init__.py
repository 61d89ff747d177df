"""Training objectives on the one loop, selected by ``objective.kind`` in the run config."""

from __future__ import annotations

from tpulab.train.config import RunConfig
from tpulab.train.objectives.base import DataSource, Objective
from tpulab.train.objectives.dpo import DPO
from tpulab.train.objectives.ppo import PPO
from tpulab.train.objectives.pretrain import Pretrain
from tpulab.train.objectives.reward import Reward
from tpulab.train.objectives.sft import SFT

KINDS: dict[str, type[Objective]] = {k.kind: k for k in (Pretrain, SFT, Reward, DPO, PPO)}

__all__ = ["KINDS", "DataSource", "Objective", "build"]


def build(config: RunConfig) -> Objective:
    """The objective ``config.objective.kind`` names, with its data and checkpoints verified."""
    return KINDS[config.objective.kind](config)
