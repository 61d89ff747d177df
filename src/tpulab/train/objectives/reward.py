"""The reward model: the SFT Transformer with a scalar head, trained on preference pairs.

``tpulab.model.value.ScalarHeadModel``, read by ``scores_at``: the body starts from
``objective.init`` (an SFT run), the head ``Dense(d_model, 1)`` from a seeded init (``seed``).
The reward of a reply is read in float32 at the input position of its last response byte, the
stop byte (``preference.read_positions``), and the loss is Bradley-Terry,
``-log sigmoid(r_w - r_l - margin) + c (r_w + r_l)^2`` (``losses.bradley_terry``). Metrics:
loss, accuracy (r_w > r_l), margin (mean r_w - r_l) and the mean reward; evaluation: the same on
the held-out pairs, next to the best accuracy any reward model can reach on their labels
(``preference.gold_optimal_accuracy``: they are Bradley-Terry draws on the gold reward r*). The
checkpoint is an ordinary run dir: ``tpulab.train.restore.load_model`` gives back that model, and
PPO scores with the same ``scores_at``.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from tpulab.config import check, field
from tpulab.data import preference
from tpulab.model.value import scalar_head_graph, with_body
from tpulab.train.objectives import losses
from tpulab.train.objectives.lm import REWARD_MODEL
from tpulab.train.objectives.pairwise import Pairwise, pair_weights, sides
from tpulab.train.registry import register_objective
from tpulab.train.restore import abstract_train_state
from tpulab.train.step import gradient_steps, merge_model


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward model's Bradley-Terry loss: -log sigmoid(r_w - r_l - margin) + c (r_w + r_l)^2."""

    margin: float = field(0.0, "a constant margin the chosen reward must clear (Llama 2), >= 0")
    centering: float = field(
        0.0, "coefficient c of the centring term (Eisenstein et al. 2023): rewards near 0, >= 0"
    )

    def __post_init__(self):
        check(self.margin >= 0.0, f"objective.reward.margin={self.margin} must be >= 0")
        check(self.centering >= 0.0, f"objective.reward.centering={self.centering} must be >= 0")


def reward_loss(graphdef, margin: float = 0.0, centering: float = 0.0):
    """``(params, frozen, batch, key) -> (loss, metrics)`` of the reward model ``graphdef``."""

    def loss(params, frozen, batch, dropout_key):
        model = merge_model(graphdef, params)
        chosen, rejected = sides(model.scores_at(batch["inputs"], batch["read"]))
        return losses.bradley_terry(
            chosen, rejected, pair_weights(batch["mask"]), margin, centering
        )

    return loss


@register_objective
class Reward(Pairwise):
    kind = "reward"
    Config = RewardConfig
    uses = ("data", "init_fallback")
    needs = {"init": "the run dir of the checkpoint it starts from"}
    refuses = {"lora": "the reward model trains every parameter"}
    produces = REWARD_MODEL

    @classmethod
    def abstract_state(cls, config, mesh):
        _, _, init_params = scalar_head_graph(config.model, config.precision, config.seed)
        return abstract_train_state(init_params, config.optim, mesh)

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        graphdef, _, _ = scalar_head_graph(config.model, config.precision, config.seed)
        return nnx.merge(graphdef, params)

    def __init__(self, config):
        super().__init__(config)
        self.gold_optimal = preference.gold_optimal_accuracy(list(self.prefs.eval))

    def _start_params(self):
        """A fresh host copy of the model's starting values: the base's parameters as the body,
        the head from the seeded init (``scalar_head_graph``, the same values every time)."""
        cfg = self.config
        _, _, init_params = scalar_head_graph(cfg.model, cfg.precision, cfg.seed)
        body = jax.device_get(self.base.plain_params())
        return with_body(jax.device_get(jax.jit(init_params)()), body)

    def steps(self, mesh):
        cfg, rw = self.config, self.config.objective.reward
        graphdef, _, init_params = scalar_head_graph(cfg.model, cfg.precision, cfg.seed)
        train_loss = reward_loss(graphdef, rw.margin, rw.centering)
        gold = self.gold_optimal

        def evaluate(params, frozen, batch):
            value, m = train_loss(params, frozen, batch, None)
            n = pair_weights(batch["mask"]).sum()
            return {
                "val_loss": (value * n, n),
                "val_accuracy": (m["accuracy"] * n, n),
                "val_margin": (m["margin"] * n, n),
                "val_gold_optimal_accuracy": (gold * n, n),
            }

        return gradient_steps(
            cfg,
            mesh,
            graphdef=graphdef,
            init_params=init_params,
            load_params=self._start_params,
            loss=train_loss,
            evaluate=evaluate,
        )

    def describe(self, steps, state) -> dict:
        return {
            "reward_model": {
                "head": f"Dense({self.config.model.d_model}, 1) + bias, float32",
                "read_at": "the input position of the last response byte (the stop byte)",
                "eval_gold_optimal_accuracy": self.gold_optimal,
            }
        }
