"""What the objectives on scikit-learn's digits share (``digits_cnn``, ``digits_mae``): the data
source (``tpulab.data.digits``: the seeded, recorded partition and its batches), the model built
from the run's family, the restore shapes, the run facts, and the step-1 inputs their audits
recompute.

A subclass names its model family (``family``: the config dataclass; ``module``: the
``nnx.Module`` built from it), its loss and evaluation, and its audits. The partition's digest is
the run's data identity and is named again in ``identities()`` beside the dataset's, so a resume
with another partition (or other pixels) is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from tpulab.config import check
from tpulab.data import digits
from tpulab.train.objective import DataSource, Objective
from tpulab.train.restore import abstract_train_state
from tpulab.train.step import Loss, Steps, gradient_steps, step_keys


class DigitsObjective(Objective):
    family: ClassVar[type] = type(None)  # the model family's config dataclass
    module: ClassVar[type] = type(None)  # the nnx.Module built from it

    @classmethod
    def check_run(cls, config) -> None:
        name = config.model.family
        check(
            isinstance(config.model, cls.family),
            f"objective.kind={cls.kind} trains model.family={cls.family().family}, not {name}",
        )
        check(
            config.model.image_size == digits.IMAGE_SIZE,
            f"objective.kind={cls.kind} reads {digits.IMAGE_SIZE}x{digits.IMAGE_SIZE} digits: "
            f"model.image_size={config.model.image_size} must be {digits.IMAGE_SIZE}",
        )

    def __init__(self, config):
        super().__init__(config)
        self.partition = digits.partition(config.data)

    @classmethod
    def graph(cls, config) -> tuple[Any, Any]:
        """(graphdef, init_params) of the run's model: its structure, and a random init from the
        run's seed (traced inside the init program)."""
        build = lambda: cls.module(config.model, rngs=nnx.Rngs(params=config.seed))  # noqa: E731
        graphdef, _ = nnx.split(nnx.eval_shape(build))
        return graphdef, lambda: nnx.split(build())[1]

    def data(self) -> DataSource:
        part, cfg = self.partition, self.config.data
        return DataSource(
            train=lambda index, count: digits.train_stream(part, cfg, index, count),
            eval_batches=digits.eval_batches(part.eval, cfg.batch_size)[
                : self.config.train.eval_batches
            ],
            identity=part.identity,
            description={"dataset": "scikit-learn digits", **part.describe()},
            row_ids=digits.row_ids,
            eval_row_ids=digits.eval_row_ids,
        )

    def identities(self) -> dict[str, str]:
        return {"digits": digits.dataset_digest(), "digits_partition": self.partition.identity}

    def gradient_steps(self, mesh, loss: Loss, evaluate) -> Steps:
        graphdef, init_params = self.graph(self.config)
        return gradient_steps(
            self.config,
            mesh,
            graphdef=graphdef,
            init_params=init_params,
            loss=loss,
            evaluate=evaluate,
            merge=lambda params, frozen: nnx.merge(graphdef, params),
        )

    @classmethod
    def abstract_state(cls, config, mesh):
        _, init_params = cls.graph(config)
        return abstract_train_state(init_params, config.optim, mesh)

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        return nnx.merge(cls.graph(config)[0], params)

    def run_facts(self, steps, state) -> dict:
        b = self.config.data.batch_size
        return {
            "param_count": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "shapes": {"batch": b, "image_size": digits.IMAGE_SIZE, **self.shapes()},
            "work": {"unit": "images", "per_step": b},
        }

    def shapes(self) -> dict[str, int]:
        """The model's own entries in ``run_facts``' shapes."""
        return {}

    def first_step(self, state: Any) -> tuple[Any, dict[str, np.ndarray], jax.Array]:
        """(params, batch, key) step 1's loss is computed from, given the starting ``state``: its
        parameters, the first global training batch and the key ``gradient_steps`` hands the
        loss at that state."""
        batch = digits.first_batch(self.partition, self.config.data)
        return state.params, batch, step_keys(state.rng)[1]


def closed_form_audit(loss: float, expected: float, rtol: float) -> dict:
    """Step 1's loss (computed before the first update) against its closed form."""
    error = abs(loss - expected) / max(abs(expected), 1e-12)
    return {
        "passed": bool(error <= rtol),
        "loss": loss,
        "expected": expected,
        "relative_error": error,
        "rtol": rtol,
    }
