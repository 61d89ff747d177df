"""A small ViT-style masked autoencoder (``model.family: mae_vit``), He et al.'s MAE at toy size.

An image of ``image_size`` x ``image_size`` pixels is cut into ``(image_size / patch)^2`` square
patches (row-major). The encoder embeds only the patches it is given (``visible_bk``: indices per
row) with their learned positions and runs pre-norm Transformer blocks over them: masked patches
never enter it. The decoder puts the encoded tokens back at their positions, a learned mask token
everywhere else, adds its own positions and predicts every patch's pixels; the objective scores the
masked ones. The pixel head starts at zero, so an untrained model predicts 0 for every pixel and
its loss has a closed form (``digits_mae``'s step-1 audit). ``features`` is the frozen encoder a
linear probe reads: every patch visible, tokens mean-pooled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tpulab.config import check, check_int, field
from tpulab.model.families import register_family


def block_params(d: int, ratio: int) -> int:
    """One pre-norm block: two LayerNorms, fused QKV and output projections, the MLP (biases)."""
    return (4 + 2 * ratio) * d * d + 9 * d + ratio * d


def mae_param_count(cfg: MAEConfig) -> int:
    d, dd, p, n = cfg.d_model, cfg.decoder_d_model, cfg.patch_pixels, cfg.patches
    encoder = p * d + d + n * d + cfg.n_layers * block_params(d, cfg.mlp_ratio) + 2 * d
    decoder = d * dd + dd + dd + n * dd + cfg.decoder_layers * block_params(dd, cfg.mlp_ratio)
    return encoder + decoder + 2 * dd + dd * p + p


@register_family("mae_vit", mae_param_count)
@dataclasses.dataclass(frozen=True)
class MAEConfig:
    """Encoder over the visible patches, a lighter decoder over all of them."""

    family: str = field("mae_vit", "this family")
    image_size: int = field(8, "square input images of this side; patch must divide it")
    patch: int = field(2, "side of a square patch, in pixels")
    d_model: int = field(64, "encoder width")
    n_layers: int = field(2, "encoder blocks")
    n_heads: int = field(4, "encoder attention heads; must divide d_model")
    decoder_d_model: int = field(32, "decoder width")
    decoder_layers: int = field(1, "decoder blocks")
    decoder_heads: int = field(2, "decoder attention heads; must divide decoder_d_model")
    mlp_ratio: int = field(2, "MLP hidden width = mlp_ratio * width, encoder and decoder")

    def __post_init__(self):
        check_int(self.image_size, "model.image_size", 1, 1024)
        check_int(self.patch, "model.patch", 1, 1024)
        check(
            self.image_size % self.patch == 0,
            f"model.patch={self.patch} does not divide model.image_size={self.image_size}",
        )
        check(self.patches >= 2, f"model.patch={self.patch} leaves one patch: nothing to mask")
        for width, heads, where in (
            (self.d_model, self.n_heads, ""),
            (self.decoder_d_model, self.decoder_heads, "decoder_"),
        ):
            check_int(width, f"model.{where}d_model", 1, 8192)
            check_int(heads, f"model.{where}heads" if where else "model.n_heads", 1, 256)
            check(
                width % heads == 0,
                f"model.{where}d_model={width} is not divisible by its {heads} heads",
            )
        check_int(self.n_layers, "model.n_layers", 1, 64)
        check_int(self.decoder_layers, "model.decoder_layers", 1, 64)
        check_int(self.mlp_ratio, "model.mlp_ratio", 1, 64)

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def patch_pixels(self) -> int:
        return self.patch * self.patch


def patchify(x_bhw: jax.Array, patch: int) -> jax.Array:
    """[b, h, w] -> [b, (h/p)(w/p), p*p]: patches in row-major order, pixels row-major within."""
    b, h, w = x_bhw.shape
    x = x_bhw.reshape(b, h // patch, patch, w // patch, patch)
    return x.transpose(0, 1, 3, 2, 4).reshape(b, (h // patch) * (w // patch), patch * patch)


class Block(nnx.Module):
    """Pre-norm self-attention (no mask: every token sees every token) and a GELU MLP."""

    def __init__(self, d: int, heads: int, ratio: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.up, self.down = (
            nnx.Linear(d, ratio * d, rngs=rngs),
            nnx.Linear(ratio * d, d, rngs=rngs),
        )

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        b, t, d = x_btd.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x_btd)), 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        att = jax.nn.dot_product_attention(split(q), split(k), split(v))
        x_btd = x_btd + self.out(att.reshape(b, t, d))
        return x_btd + self.down(jax.nn.gelu(self.up(self.ln2(x_btd))))


class MAE(nnx.Module):
    def __init__(self, cfg: MAEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, dd, n, p = cfg.d_model, cfg.decoder_d_model, cfg.patches, cfg.patch_pixels
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Linear(p, d, rngs=rngs)
        self.pos = nnx.Param(normal(rngs.params(), (n, d)))
        self.encoder = nnx.List(
            [Block(d, cfg.n_heads, cfg.mlp_ratio, rngs=rngs) for _ in range(cfg.n_layers)]
        )
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.to_decoder = nnx.Linear(d, dd, rngs=rngs)
        self.mask_token = nnx.Param(normal(rngs.params(), (dd,)))
        self.decoder_pos = nnx.Param(normal(rngs.params(), (n, dd)))
        self.decoder = nnx.List(
            [
                Block(dd, cfg.decoder_heads, cfg.mlp_ratio, rngs=rngs)
                for _ in range(cfg.decoder_layers)
            ]
        )
        self.decoder_norm = nnx.LayerNorm(dd, rngs=rngs)
        self.head = nnx.Linear(dd, p, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def encode(self, patches_blp: jax.Array, visible_bk: jax.Array) -> jax.Array:
        """The encoder over the patches ``visible_bk`` names (and no other): [b, k, d]."""
        rows = jnp.arange(patches_blp.shape[0])[:, None]
        x = self.embed(patches_blp[rows, visible_bk]) + self.pos[...][visible_bk]
        for block in self.encoder:
            x = block(x)
        return self.norm(x)

    def features(self, x_bhw: jax.Array) -> jax.Array:
        """[b, h, w] images -> [b, d_model]: every patch visible, the encoder's tokens averaged."""
        patches = patchify(x_bhw, self.cfg.patch)
        b, n, _ = patches.shape
        every = jnp.broadcast_to(jnp.arange(n), (b, n))
        return self.encode(patches, every).mean(axis=1)

    def __call__(self, patches_blp: jax.Array, visible_bk: jax.Array) -> jax.Array:
        """Predicted pixels of every patch, [b, L, p*p], from the visible patches alone."""
        return self.decode(self.decoder_tokens(patches_blp, visible_bk))

    def decoder_tokens(self, patches_blp: jax.Array, visible_bk: jax.Array) -> jax.Array:
        """[b, L, decoder_d_model]: each visible patch's encoded token at its position, the mask
        token at every other."""
        b, n, _ = patches_blp.shape
        tokens = self.to_decoder(self.encode(patches_blp, visible_bk))
        x = jnp.broadcast_to(self.mask_token[...], (b, n, tokens.shape[-1]))
        return x.at[jnp.arange(b)[:, None], visible_bk].set(tokens)

    def decode(self, x_bld: jax.Array) -> jax.Array:
        """Decoder tokens -> every patch's predicted pixels, [b, L, p*p]."""
        x = x_bld + self.decoder_pos[...]
        for block in self.decoder:
            x = block(x)
        return self.head(self.decoder_norm(x)).astype(jnp.float32)
