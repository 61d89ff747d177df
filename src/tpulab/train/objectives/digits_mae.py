"""Masked-autoencoder pretraining on scikit-learn's digits (``objective.kind: digits_mae``).

Each image is cut into ``model.patch``-sided patches (L of them); ``floor(mask_ratio * L)`` are
masked by a keyed permutation per image (the first that many of the argsort of uniform noise drawn
from the step's key, as MAE draws it), the
encoder sees only the rest (``tpulab.model.mae``), the decoder predicts every patch and the loss is
the mean squared error over the masked patches' pixels alone, divided by their count. The key is
the step's share of the state's key (``step.step_keys``), so a resumed run masks exactly what the
uninterrupted one did. ``norm_pix``: the targets are each patch's pixels standardised by that
patch's own mean and variance (never a statistic of other patches or images). Validation masks
each held-out image with a key of its dataset index alone, so ``val_loss`` is the same whatever the
batching.

Audits (``audits``, before step 1; audits.json): the masked patches the loss counts are exactly
``floor(mask_ratio * L) * B``; the loss's gradient with respect to the target pixels is zero on
every visible patch and non-zero on every masked one (an inverted mask polarity fails it); the
gradient with respect to the model's input pixels is zero on every masked patch (a decoder handed
the true masked pixels fails it); step 1's loss equals its closed form (the pixel head starts at
zero: the mean over masked patches of the targets' mean square).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.config import check, field
from tpulab.model.mae import MAE, MAEConfig, patchify
from tpulab.train.objectives.digits import DigitsObjective, closed_form_audit
from tpulab.train.registry import register_objective
from tpulab.train.step import Steps, input_gradients

NORM_EPS = 1e-6  # added to a patch's variance before its pixels are standardised (MAE's)
STEP1_RTOL = 1e-5
EVAL_STREAM = 2  # fold_in(PRNGKey(seed), EVAL_STREAM): the root of the validation masks
AUDIT_STREAM = 3  # ... of the audits' random targets and jittered parameters
JITTER = 0.02  # the audits' parameter noise: no path (the zero head) hides a leak


def masked_count(mask_ratio: float, patches: int) -> int:
    """Patches masked per image: floor(mask_ratio * L) (rounded to 9 places first, so that 0.29 *
    100 is 29, not 28.999...)."""
    return math.floor(round(mask_ratio * patches, 9))


def mask_rows(noise_bl, n_masked: int):
    """Each image's keyed permutation of its L patches (``argsort`` of its uniform noise, as MAE
    draws it): the first ``n_masked`` are masked. Returns (visible_bk: the other indices,
    ascending; masked_bl: bool)."""
    perms = jnp.argsort(noise_bl, axis=1)
    visible = jnp.sort(perms[:, n_masked:], axis=1)
    rows = jnp.arange(perms.shape[0])[:, None]
    return visible, jnp.ones(perms.shape, bool).at[rows, visible].set(False)


def patch_targets(patches_blp, norm_pix: bool):
    """What the decoder must reproduce: the pixels, or each patch standardised by its own mean
    and variance."""
    if not norm_pix:
        return patches_blp
    mean = patches_blp.mean(axis=-1, keepdims=True)
    var = patches_blp.var(axis=-1, keepdims=True)
    return (patches_blp - mean) / jnp.sqrt(var + NORM_EPS)


def masked_patch_sums(pred_blp, target_blp, scored_bl):
    """(sum over scored patches of their mean squared pixel error, scored patches (float)): the
    loss is the first over the second, the count of targets, never a per-row mean."""
    per_patch = ((pred_blp - target_blp) ** 2).mean(axis=-1)
    weight = scored_bl.astype(jnp.float32)
    return jnp.sum(jnp.where(weight > 0, per_patch, 0.0) * weight), jnp.sum(weight)


@register_objective
class DigitsMAE(DigitsObjective):
    kind = "digits_mae"
    family = MAEConfig
    module = MAE

    @dataclasses.dataclass(frozen=True)
    class Config:
        """What is masked and what the decoder must reproduce."""

        mask_ratio: float = field(0.75, "share of each image's patches masked, in (0, 1)")
        norm_pix: bool = field(False, "targets standardised per patch, by that patch alone")

        def __post_init__(self):
            check(
                0.0 < self.mask_ratio < 1.0,
                f"objective.digits_mae.mask_ratio={self.mask_ratio} must be in (0, 1)",
            )

    @classmethod
    def check_run(cls, config) -> None:
        super().check_run(config)
        n, ratio = config.model.patches, config.objective.options.mask_ratio
        masked = masked_count(ratio, n)
        check(
            1 <= masked <= n - 1,
            f"objective.{cls.kind}.mask_ratio={ratio} masks {masked} of {n} patches: at least "
            "one must be masked and one visible",
        )

    @property
    def n_masked(self) -> int:
        return masked_count(self.options.mask_ratio, self.config.model.patches)

    def scored(self, masked_bl):
        """The patches the loss scores: the masked ones."""
        return masked_bl

    def noise(self, key, batch: int):
        """A training batch's mask noise: one uniform draw per patch from the step's key."""
        return jax.random.uniform(key, (batch, self.config.model.patches))

    def forward(self, graphdef, params, images_in, images_target, noise_bl, row_weight=None):
        """(sum, count, masked_bl): the masked-patch error of the model on ``images_in``, scored
        against ``images_target`` (the same images, but for the audits, which separate the two
        paths to take each one's gradient)."""
        cfg = self.config.model
        visible, masked = mask_rows(noise_bl, self.n_masked)
        pred = nnx.merge(graphdef, params)(patchify(images_in, cfg.patch), visible)
        target = patch_targets(patchify(images_target, cfg.patch), self.options.norm_pix)
        scored = self.scored(masked)
        if row_weight is not None:
            scored = scored * row_weight[:, None]
        total, count = masked_patch_sums(pred, target, scored)
        return total, count, masked

    def loss(self, graphdef):
        def loss(params, frozen, batch, key):
            x = batch["x"]
            total, count, _ = self.forward(graphdef, params, x, x, self.noise(key, x.shape[0]))
            return total / jnp.maximum(count, 1.0), {"masked_patches": count.astype(jnp.int32)}

        return loss

    def steps(self, mesh) -> Steps:
        graphdef, _ = self.graph(self.config)
        root = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), EVAL_STREAM)

        def evaluate(params, frozen, batch):
            n = self.config.model.patches
            noise = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(root, i), (n,)))(
                batch["index"]
            )
            x, w = batch["x"], batch["weight"]
            total, count, _ = self.forward(graphdef, params, x, x, noise, w)
            return {"val_loss": (total, count)}

        return self.gradient_steps(mesh, self.loss(graphdef), evaluate)

    def shapes(self) -> dict[str, int]:
        m = self.config.model
        return {
            "patch": m.patch,
            "patches": m.patches,
            "masked_per_image": self.n_masked,
            "d_model": m.d_model,
            "decoder_d_model": m.decoder_d_model,
        }

    # --- the audits -------------------------------------------------------------------------------

    def probe_paths(self, graphdef):
        """One program: step 1's (loss, count, masked) and, on jittered parameters and random
        targets, the gradients of the loss with respect to the target pixels and to the input
        pixels (the two paths are separate arguments, so each gradient is its path's alone)."""

        def run(params, x, key, audit_key):
            noise = self.noise(key, x.shape[0])
            total, count, masked = self.forward(graphdef, params, x, x, noise)
            target_key, jitter_key = jax.random.split(audit_key)
            flat, unravel = jax.flatten_util.ravel_pytree(params)
            jittered = unravel(flat + JITTER * jax.random.normal(jitter_key, flat.shape))

            def through(images_in, images_target):
                s, c, _ = self.forward(graphdef, jittered, images_in, images_target, noise)
                return s / jnp.maximum(c, 1.0)

            random_target = jax.random.uniform(target_key, x.shape)
            g_input, g_target = input_gradients(through, x, random_target)
            return total / jnp.maximum(count, 1.0), count, masked, g_target, g_input

        return jax.jit(run)

    def audits(self, steps: Steps, state) -> dict[str, dict]:
        cfg = self.config.model
        params, batch, key = self.first_step(state)
        x = batch["x"]
        b = x.shape[0]
        audit_key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), AUDIT_STREAM)
        loss, count, masked, g_target, g_input = jax.device_get(
            self.probe_paths(steps.graphdef)(params, x, key, audit_key)
        )
        masked = np.asarray(masked)
        per_patch = lambda g: np.abs(np.asarray(patchify(g, cfg.patch))).sum(-1) > 0  # noqa: E731
        touched_target, touched_input = per_patch(g_target), per_patch(g_input)
        expected_count = self.n_masked * b
        return {
            "masked_count": {
                "passed": bool(
                    int(count) == expected_count and (masked.sum(1) == self.n_masked).all()
                ),
                "masked_patches": int(count),
                "expected": expected_count,
                "per_image": self.n_masked,
                "patches": cfg.patches,
                "batch": b,
                "images_with_another_count": int((masked.sum(1) != self.n_masked).sum()),
            },
            "loss_reads_masked_patches_only": {
                "passed": bool(not touched_target[~masked].any() and touched_target[masked].all()),
                "visible_patches_in_loss": int(touched_target[~masked].sum()),
                "masked_patches_not_in_loss": int((~touched_target[masked]).sum()),
            },
            "masked_pixels_never_reach_the_model": {
                "passed": bool(not touched_input[masked].any() and touched_input[~masked].any()),
                "masked_patches_reaching_the_model": int(touched_input[masked].sum()),
                "visible_patches_reaching_the_model": int(touched_input[~masked].sum()),
            },
            "step1_loss": closed_form_audit(
                float(loss), self.closed_form_step1(x, masked), STEP1_RTOL
            ),
        }

    def closed_form_step1(self, x: np.ndarray, masked: np.ndarray) -> float:
        """Step 1's loss with the zero pixel head (every prediction 0): the mean over the masked
        patches of their targets' mean square, in float64 with numpy."""
        p = self.config.model.patch
        b, h, w = x.shape
        patches = (
            np.asarray(x, np.float64)
            .reshape(b, h // p, p, w // p, p)
            .transpose(0, 1, 3, 2, 4)
            .reshape(b, -1, p * p)
        )
        if self.options.norm_pix:
            mean = patches.mean(-1, keepdims=True)
            patches = (patches - mean) / np.sqrt(patches.var(-1, keepdims=True) + NORM_EPS)
        return float((patches**2).mean(-1)[masked].mean())
