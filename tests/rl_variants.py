"""A PPO variant outside ``src/`` (named ``rl_variants:FlippedPPO``): the advantages' sign
flipped, the negative control of tests/test_rl_objective.py's learning check."""

from __future__ import annotations

from tpulab.train.objectives.rl_ppo import PPOEnv
from tpulab.train.registry import register_objective


@register_objective
class FlippedPPO(PPOEnv):
    kind = "flipped_ppo"
    Config = PPOEnv.Config

    @staticmethod
    def surrogate(adv, ratio, clip: float):
        return PPOEnv.surrogate(-adv, ratio, clip)
