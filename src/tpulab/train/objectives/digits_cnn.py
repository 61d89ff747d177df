"""A small CNN classifier on scikit-learn's digits (``objective.kind: digits_cnn``): the
supervised reference the MAE probe is read against.

Softmax cross-entropy over the 10 classes, mean over the batch; ``accuracy`` per step and
``val_loss`` / ``val_accuracy`` over every held-out image of the recorded partition. Its audit: the
classifier head starts at zero, so step 1's loss (computed before the first update) is ln 10 on any
batch, to float32 rounding.
"""

from __future__ import annotations

import math

import jax
import optax
from flax import nnx

from tpulab.model.cnn import CNN, CNNConfig
from tpulab.train.objectives.digits import DigitsObjective, closed_form_audit
from tpulab.train.registry import register_objective
from tpulab.train.step import Steps

STEP1_RTOL = 1e-6


def classifier_loss(graphdef):
    def loss(params, frozen, batch, key):
        logits = nnx.merge(graphdef, params)(batch["x"])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return xent.mean(), {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    return loss


def classifier_eval(graphdef):
    def evaluate(params, frozen, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        w = batch["weight"]
        right = (logits.argmax(-1) == batch["y"]) * w
        return {"val_loss": ((xent * w).sum(), w.sum()), "val_accuracy": (right.sum(), w.sum())}

    return evaluate


@register_objective
class DigitsCNN(DigitsObjective):
    kind = "digits_cnn"
    family = CNNConfig
    module = CNN

    def steps(self, mesh) -> Steps:
        graphdef, _ = self.graph(self.config)
        return self.gradient_steps(mesh, classifier_loss(graphdef), classifier_eval(graphdef))

    def shapes(self) -> dict[str, int]:
        m = self.config.model
        return {"channels": m.channels, "hidden": m.hidden, "classes": m.classes}

    def audits(self, steps: Steps, state) -> dict[str, dict]:
        params, batch, key = self.first_step(state)
        loss = jax.jit(classifier_loss(steps.graphdef))
        value, _ = loss(params, None, steps.put_global(batch), key)
        expected = math.log(self.config.model.classes)
        return {"step1_loss": closed_form_audit(float(value), expected, STEP1_RTOL)}
