"""The built-in objectives on the one loop: importing this package registers them
(``tpulab.train.registry``), and ``objective.kind`` selects one."""

from __future__ import annotations

from tpulab.train.objective import DataSource, Objective
from tpulab.train.objectives.digits_cnn import DigitsCNN
from tpulab.train.objectives.digits_mae import DigitsMAE
from tpulab.train.objectives.dpo import DPO
from tpulab.train.objectives.mlm import MLM
from tpulab.train.objectives.ppo import PPO
from tpulab.train.objectives.pretrain import Pretrain
from tpulab.train.objectives.reward import Reward
from tpulab.train.objectives.rl_ppo import PPOEnv
from tpulab.train.objectives.sft import SFT
from tpulab.train.registry import objective_class

__all__ = [
    "DPO",
    "DigitsCNN",
    "DigitsMAE",
    "MLM",
    "PPO",
    "SFT",
    "PPOEnv",
    "DataSource",
    "Objective",
    "Pretrain",
    "Reward",
    "build",
]


def build(config) -> Objective:
    """The objective ``config.objective.kind`` names, with its data and checkpoints verified."""
    return objective_class(config.objective.kind)(config)
