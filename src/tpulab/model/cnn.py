"""A small CNN image classifier (``model.family: cnn``): the supervised reference on the digits.

Two 3x3 convolutions (``channels``, then twice as many; ReLU), a 2x2 max-pool, a dense layer and a
classifier head initialised at zero, so the untrained model's loss is exactly ln(classes) on any
batch (the step-1 audit of ``digits_cnn``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tpulab.config import check, check_int, field
from tpulab.model.families import register_family


def cnn_param_count(cfg: CNNConfig) -> int:
    c, h, s = cfg.channels, cfg.hidden, cfg.image_size // 2
    return (
        (9 * c + c)
        + (9 * c * 2 * c + 2 * c)
        + (s * s * 2 * c * h + h)
        + (h * cfg.classes + cfg.classes)
    )


@register_family("cnn", cnn_param_count)
@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """conv3x3(channels) -> conv3x3(2 channels) -> maxpool 2x2 -> dense(hidden) -> classes."""

    family: str = field("cnn", "this family")
    image_size: int = field(8, "square input images of this side; must be even (the 2x2 pool)")
    channels: int = field(16, "channels of the first convolution; the second has twice as many")
    hidden: int = field(64, "units of the dense layer before the classifier")
    classes: int = field(10, "classes the head scores")

    def __post_init__(self):
        check_int(self.image_size, "model.image_size", 2, 1024)
        check(
            self.image_size % 2 == 0,
            f"model.image_size={self.image_size} must be even (the 2x2 pool)",
        )
        check_int(self.channels, "model.channels", 1, 1024)
        check_int(self.hidden, "model.hidden", 1, 65536)
        check_int(self.classes, "model.classes", 2, 65536)


class CNN(nnx.Module):
    def __init__(self, cfg: CNNConfig, *, rngs: nnx.Rngs):
        c, s = cfg.channels, cfg.image_size // 2
        self.conv1 = nnx.Conv(1, c, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(c, 2 * c, (3, 3), rngs=rngs)
        self.dense = nnx.Linear(s * s * 2 * c, cfg.hidden, rngs=rngs)
        zeros = nnx.initializers.zeros
        self.head = nnx.Linear(cfg.hidden, cfg.classes, kernel_init=zeros, rngs=rngs)

    def __call__(self, x_bhw: jax.Array) -> jax.Array:
        """[b, h, w] images -> [b, classes] logits."""
        h = jax.nn.relu(self.conv1(x_bhw[..., None]))
        h = jax.nn.relu(self.conv2(h))
        b, hh, ww, c = h.shape
        h = h.reshape(b, hh // 2, 2, ww // 2, 2, c).max(axis=(2, 4))
        return self.head(jax.nn.relu(self.dense(h.reshape(b, -1)))).astype(jnp.float32)
