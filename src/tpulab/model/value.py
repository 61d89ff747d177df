"""A Transformer with a float32 scalar head on its final hidden state: PPO's policy with its value
head, and the reward model. One class, one checkpoint layout for both roles.

``body`` is a whole ``Transformer`` (a language model's parameters drop in as they are; with tied
embeddings, the default, it has no LM head to carry) and ``score`` is ``Dense(d_model, 1)`` with a
bias, run in float32 whatever the compute dtype. The roles differ only in what they read:

- ``__call__``: one trunk pass gives both the body's logits and a scalar per position, the value
  head of PPO's policy sharing its trunk, as in Ziegler et al. 2019 (lm-human-preferences);
- ``scores_at``: the scalar at one input position per row, the last response byte (the stop
  byte, ``tpulab.data.preference``): the reward. Causal attention means bytes after it cannot
  change it. The reward objective trains through it and PPO scores through it: the same function.

The head's seeded init is ``normal(0.02)`` (what a reward model starts from); PPO starts its value
head at zero instead (``objectives.ppo``), so its first advantages are the returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpulab.model.config import ModelConfig, PrecisionConfig
from tpulab.model.transformer import Transformer

SCORE_INIT_STD = 0.02  # the head's seeded init: Hugging Face's initializer_range for score heads


class ScalarHeadModel(nnx.Module):
    """tokens [B, T] -> (logits [B, T, V], scalars [B, T] float32); ``scores_at``: [B] float32."""

    def __init__(self, cfg: ModelConfig, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        self.body = Transformer(cfg, prec, rngs=rngs)
        self.score = nnx.Linear(
            cfg.d_model,
            1,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=nnx.initializers.normal(SCORE_INIT_STD),
            rngs=rngs,
        )

    def trunk(self, tokens_bt: jax.Array) -> jax.Array:
        """The residual stream after the last block [B, T, D] (dropout off: what PPO samples and
        scores with, and the reward the reward model is trained on, are deterministic)."""
        body = self.body
        x_btd = body.embed(tokens_bt)
        for block in body.blocks:
            x_btd = block(x_btd, None, deterministic=True, rngs=None)
        return x_btd

    def head(self, x_btd: jax.Array) -> jax.Array:
        """The scalar of every position [B, T] float32, from the final-norm hidden state."""
        h_btd = self.body.final_norm(x_btd).astype(jnp.float32)
        return self.score(h_btd)[..., 0]

    def __call__(self, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        x_btd = self.trunk(tokens_bt)
        return self.body.logits(x_btd), self.head(x_btd)

    def scores_at(self, tokens_bt: jax.Array, read_b: jax.Array) -> jax.Array:
        """The scalar at input position ``read_b[b]`` of each row [B] float32 (no LM head)."""
        x_btd = self.trunk(tokens_bt)
        x_b1d = jnp.take_along_axis(x_btd, read_b.astype(jnp.int32)[:, None, None], axis=1)
        return self.head(x_b1d)[:, 0]


def scalar_head_graph(
    cfg: ModelConfig, prec: PrecisionConfig, seed: int
) -> tuple[Any, Any, Callable[[], Any]]:
    """(graphdef, abstract params, init_params): the structure, its shapes, and the seeded init."""

    def build() -> ScalarHeadModel:
        return ScalarHeadModel(cfg, prec, rngs=nnx.Rngs(params=seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    return graphdef, abstract, lambda: nnx.split(build())[1]


def with_body(params: Any, body_params: Any) -> Any:
    """The parameters ``params`` with ``body`` replaced (a language model's params)."""
    out = jax.tree.map(lambda x: x, params)  # a new State: the caller's stays as it was
    out["body"] = body_params
    return out
