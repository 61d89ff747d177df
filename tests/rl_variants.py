"""PPO variants outside ``src/``: ``rl_variants:FlippedPPO``, the advantages' sign flipped (the
negative control of tests/test_rl_objective.py's learning check), and ``rl_variants:SharedKeyPPO``,
every seed given one key (the negative control of tests/test_rl_seeds.py's distinct curves)."""

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


@register_objective
class SharedKeyPPO(PPOEnv):
    """The key bug ``tpulab seeds`` must catch (named ``rl_variants:SharedKeyPPO``): every lane
    starts from the run's one seed, so the seeds train identical curves."""

    kind = "shared_key_ppo"
    Config = PPOEnv.Config

    @classmethod
    def lane_seeds(cls, config) -> list[int]:
        return [config.seed] * config.objective.options.seeds
