"""A Transformer with a float32 scalar head on its final hidden state: a value or reward model.

``body`` is a whole ``Transformer`` (a language model's parameters drop in as they are) and
``score`` is ``Dense(d_model, 1)`` with a bias, run in float32 whatever the compute dtype. One trunk
pass gives both the body's logits and a scalar per position (``__call__``): PPO's policy and its
value head share the trunk, as in Ziegler et al. 2019 (lm-human-preferences). A reward model is the
same layout read at one position per row, the last response byte (``scores_at``); with causal
attention nothing after that byte can change it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tpulab.model.config import ModelConfig, PrecisionConfig
from tpulab.model.transformer import Transformer


class ValueModel(nnx.Module):
    """tokens [B, T] -> (logits [B, T, V], scalars [B, T] float32)."""

    def __init__(
        self,
        cfg: ModelConfig,
        prec: PrecisionConfig,
        *,
        rngs: nnx.Rngs,
        head_init=None,
    ):
        self.body = Transformer(cfg, prec, rngs=rngs)
        self.score = nnx.Linear(
            cfg.d_model,
            1,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=head_init or nnx.initializers.zeros_init(),
            rngs=rngs,
        )

    def trunk(self, tokens_bt: jax.Array) -> jax.Array:
        """The residual stream after the last block [B, T, D] (dropout off: what PPO samples and
        scores with is deterministic)."""
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
