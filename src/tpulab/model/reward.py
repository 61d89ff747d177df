"""A reward model: the byte Transformer's final hidden state read at one position, a scalar head.

``RewardModel.body`` is a whole ``Transformer`` (so an SFT checkpoint's parameters drop in as they
are; with tied embeddings, the default, it has no LM head to carry); ``score`` is
``Dense(d_model, 1)`` with a bias. The reward of a row is read at one input position per row, the
one holding the last response byte (the stop byte, ``tpulab.data.preference``): causal attention
means bytes after it cannot change it. The head runs in float32 whatever the compute dtype, and
the reward is float32.
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


class RewardModel(nnx.Module):
    """tokens [B, T] int32, read positions [B] int32 -> rewards [B] float32."""

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

    def hidden(
        self, tokens_bt: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> jax.Array:
        """The final-norm hidden states [B, T, D]: what the LM head of ``body`` would read."""
        body = self.body
        x_btd = body.embed(tokens_bt)
        for block in body.blocks:
            x_btd = block(x_btd, None, deterministic=deterministic, rngs=rngs)
        return body.final_norm(x_btd)

    def __call__(
        self,
        tokens_bt: jax.Array,
        read_b: jax.Array,
        *,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        h_btd = self.hidden(tokens_bt, deterministic=deterministic, rngs=rngs)
        h_bd = jnp.take_along_axis(h_btd, read_b.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        return self.score(h_bd.astype(jnp.float32))[:, 0]


def reward_graph(
    cfg: ModelConfig, prec: PrecisionConfig, seed: int
) -> tuple[Any, Callable[[], Any]]:
    """(graphdef, init_params): the reward model's structure, and a random init from ``seed``."""

    def build() -> RewardModel:
        return RewardModel(cfg, prec, rngs=nnx.Rngs(params=seed))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return graphdef, lambda: nnx.split(build())[1]


def with_body(params: Any, body_params: Any) -> Any:
    """The reward model's parameters ``params`` with ``body`` replaced (an SFT model's params)."""
    out = jax.tree.map(lambda x: x, params)  # a new State: the caller's stays as it was
    out["body"] = body_params
    return out
