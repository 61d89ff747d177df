"""Negative controls of ``digits_mae``'s audits, outside ``src/``: each a subclass that breaks one
thing a shipped MAE has been known to get wrong, and that the audits must catch.

- ``InvertedMask``: the loss scores the visible patches (the mask's polarity read the wrong way,
  as when True meant keep);
- ``LeakyDecoder`` (model ``LeakyMAE``): the decoder is handed every masked patch's true pixels,
  so the loss can fall toward 0 without learning anything about the hidden patches.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpulab import register_objective
from tpulab.model.mae import MAE
from tpulab.train.objectives.digits_mae import DigitsMAE


class LeakyMAE(MAE):
    def decoder_tokens(self, patches_blp, visible_bk):
        x = super().decoder_tokens(patches_blp, visible_bk)
        b, n, _ = patches_blp.shape
        masked = jnp.ones((b, n), bool).at[jnp.arange(b)[:, None], visible_bk].set(False)
        return x + jnp.where(masked[..., None], self.to_decoder(self.embed(patches_blp)), 0.0)


@register_objective
class LeakyDecoder(DigitsMAE):
    kind = "digits_mae_leaky"
    module = LeakyMAE


@register_objective
class InvertedMask(DigitsMAE):
    kind = "digits_mae_inverted"

    def scored(self, masked_bl):
        return ~masked_bl
