"""PPO's own config section, ``objective.ppo``, and its rules across the run config's sections."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from tpulab.config import check, check_int, field


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO-RLHF (Schulman et al. 2017; Ziegler et al. 2019): a round samples ``rollouts`` replies
    through the compiled generation loop, scores them, then takes ``epochs x minibatches`` updates,
    one per loop step."""

    rollouts: int = field(
        16,
        "replies sampled per round: a multiple of data.batch_size (each "
        "prompt of the round's batch is sampled rollouts / batch_size times)",
    )
    max_new: int = field(32, "reply bytes sampled at most (the stop byte ends a reply early)")
    temperature: float = field(
        1.0,
        "sampling temperature, in [0.001, 10]; the trainer's "
        "log-probs use the same (softmax(logits / t))",
    )
    epochs: int = field(2, "passes over a round's rollouts")
    minibatches: int = field(2, "minibatches per epoch: each is one loop step (one update)")
    clip: float = field(
        0.2, "policy clip range epsilon: ratios clipped to [1 - eps, 1 + eps], in (0, 1)"
    )
    value_clip: float = field(
        0.2,
        "value clip range: a value moves at most this far from its rollout value per round, > 0",
    )
    gamma: float = field(1.0, "discount gamma of GAE, in [0, 1]")
    lam: float = field(0.95, "GAE lambda, in [0, 1]")
    kl_coef: float = field(0.05, "per-token KL penalty beta against the frozen reference, >= 0")
    kl_estimator: Literal["k1", "k3"] = field(
        "k1",
        "the per-token KL in the penalty: k1 = log(p / p_ref), k3 = (r - 1) - log r with "
        "r = p_ref / p (Schulman 2020)",
    )
    entropy_coef: float = field(0.0, "entropy bonus coefficient, >= 0")
    vf_coef: float = field(0.1, "value-loss coefficient, >= 0")

    def __post_init__(self):
        from tpulab.model.config import MAX_TEMPERATURE, MIN_TEMPERATURE

        for name in ("rollouts", "max_new", "epochs", "minibatches"):
            check_int(getattr(self, name), f"objective.ppo.{name}", 1, 2**16)
        for name in (
            "temperature",
            "clip",
            "value_clip",
            "gamma",
            "lam",
            "kl_coef",
            "entropy_coef",
            "vf_coef",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value),
                f"objective.ppo.{name}={value!r} must be a finite number",
            )
        t = self.temperature
        check(
            MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
            f"objective.ppo.temperature={t} must be in [{MIN_TEMPERATURE:g}, "
            f"{MAX_TEMPERATURE:g}] (PPO samples: 0, greedy, has no log-probabilities)",
        )
        check(0.0 < self.clip < 1.0, f"objective.ppo.clip={self.clip} must be in (0, 1)")
        check(self.value_clip > 0.0, f"objective.ppo.value_clip={self.value_clip} must be > 0")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            check(0.0 <= value <= 1.0, f"objective.ppo.{name}={value} must be in [0, 1]")
        for name in ("kl_coef", "entropy_coef", "vf_coef"):
            value = getattr(self, name)
            check(value >= 0.0, f"objective.ppo.{name}={value} must be >= 0")
        check(
            self.rollouts % self.minibatches == 0,
            f"objective.ppo.rollouts={self.rollouts} is not divisible by "
            f"objective.ppo.minibatches={self.minibatches}",
        )

    @property
    def steps_per_round(self) -> int:
        return self.epochs * self.minibatches


def check_ppo_run(config) -> None:
    """PPO's rules across sections: a round's prompts and replies fit the batch and the window."""
    ppo = config.objective.options
    check(
        ppo.rollouts % config.data.batch_size == 0,
        f"objective.ppo.rollouts={ppo.rollouts} is not a multiple of "
        f"data.batch_size={config.data.batch_size} (the prompts of a round)",
    )
    check(
        ppo.max_new <= config.data.seq_len - 4,
        f"objective.ppo.max_new={ppo.max_new} leaves no room in data.seq_len="
        f"{config.data.seq_len} for a prompt (BOS, SOH, a byte, STX: at most seq_len - 4)",
    )
