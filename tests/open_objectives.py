"""Two objectives defined outside ``src/``, the working examples of docs/extending.md.

Each is named in a run config by its import path (``objective.kind: open_objectives:Digits``), so
the fresh processes that ``prove-resume``, ``chaos`` and ``launch`` start import this module
again (``tests/`` on their ``PYTHONPATH``) and train the same objective:

- ``Digits``: a two-layer MLP, a model family of its own (``model.family:
  open_objectives:MLPConfig``, ``model.hidden``), on scikit-learn's bundled 8x8 digits (1,797
  images, in the wheel: nothing downloaded), with its own ``DataSource``: a Grain stream of image
  rows whose position the checkpoint stores, and each row's identity (the sha256 of its pixels and
  label) for the window ledger. Its own option: ``objective.digits.train_images``.
- ``Counter``: a ``DataSource`` with no training iterator. Its data is a counter in the state,
  advanced by a fixed rule each step (as an RL environment's state would be): the checkpoint
  holds no data position, and the whole-state verdict compares the counter with the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab import DataSource, Objective, gradient_steps, register_family, register_objective
from tpulab.config import check, field
from tpulab.data.pipeline import READ_OPTIONS, process_batches
from tpulab.train import sharding
from tpulab.train.objectives.digits_cnn import classifier_eval, classifier_loss
from tpulab.train.restore import abstract_train_state
from tpulab.train.step import Bound, Steps, optimizer, tree_all_finite

N_TRAIN = 1500  # of the 1,797 digits: the first 1,500 train (by default), the rest are held out
MLP_FAMILY = "open_objectives:MLPConfig"  # how a run config names the family below


# --- Digits: a model family and a data source of its own ---------------------------------------


def mlp_param_count(cfg) -> int:
    return 64 * cfg.hidden + cfg.hidden + cfg.hidden * 10 + 10


@register_family("mlp", mlp_param_count)
@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """A two-layer MLP over 64 pixels, 10 classes."""

    family: str = field(MLP_FAMILY, "this family, by import path")
    hidden: int = field(32, "hidden units")

    def __post_init__(self):
        check(1 <= self.hidden <= 4096, f"model.hidden={self.hidden} must be in [1, 4096]")


class MLP(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x_bf):
        return self.out(jax.nn.relu(self.up(x_bf)))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


def _row_ids(batch: dict) -> list[str]:
    return [
        hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()[:32]
        for x, y in zip(np.asarray(batch["x"]), np.asarray(batch["y"]))
    ]


def _eval_row_ids(batch: dict) -> list[str]:
    return [h for h, w in zip(_row_ids(batch), np.asarray(batch["weight"])) if w > 0]


@register_objective
class Digits(Objective):
    kind = "digits"

    @dataclasses.dataclass(frozen=True)
    class Config:
        """How the digits are split."""

        train_images: int = field(N_TRAIN, "the first this many train; the rest are held out")

        def __post_init__(self):
            check(
                100 <= self.train_images <= 1700,
                f"objective.digits.train_images={self.train_images} must be in [100, 1700]",
            )

    @classmethod
    def check_run(cls, config) -> None:
        check(
            isinstance(config.model, MLPConfig),
            f"objective.kind={config.objective.kind} trains model.family={MLP_FAMILY}, not "
            f"{config.model.family}",
        )

    def __init__(self, config):
        super().__init__(config)
        self.x, self.y = _digits()

    @classmethod
    def _graph(cls, config):
        build = lambda: MLP(config.model.hidden, rngs=nnx.Rngs(config.seed))  # noqa: E731
        graphdef, _ = nnx.split(nnx.eval_shape(build))
        return graphdef, lambda: nnx.split(build())[1]

    def data(self) -> DataSource:
        x, y, cfg = self.x, self.y, self.config
        n_train = cfg.objective.options.train_images

        def train(index: int, count: int):
            rows = np.arange(n_train, dtype=np.int64)
            ds = process_batches(rows, cfg.data, index, count)
            return iter(ds.map(lambda r: {"x": x[r], "y": y[r]}).to_iter_dataset(READ_OPTIONS))

        held = np.arange(n_train, len(y))
        size = cfg.data.batch_size
        evals = []
        for i in range(0, len(held), size):
            idx = held[i : i + size]
            pad = size - len(idx)
            evals.append(
                {
                    "x": np.concatenate([x[idx], np.zeros((pad, 64), np.float32)]),
                    "y": np.concatenate([y[idx], np.zeros((pad,), np.int32)]),
                    "weight": np.concatenate([np.ones(len(idx)), np.zeros(pad)]).astype(np.float32),
                }
            )
        digest = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
        return DataSource(
            train=train,
            eval_batches=evals,
            identity=digest,
            description={"dataset": "sklearn digits", "train": n_train, "held_out": len(held)},
            row_ids=_row_ids,
            eval_row_ids=_eval_row_ids,
        )

    def steps(self, mesh) -> Steps:
        graphdef, init_params = self._graph(self.config)

        # the classifier's loss and evaluation are the platform's (the digits CNN's), reused
        return gradient_steps(
            self.config,
            mesh,
            graphdef=graphdef,
            init_params=init_params,
            loss=classifier_loss(graphdef),
            evaluate=classifier_eval(graphdef),
            merge=lambda params, frozen: nnx.merge(graphdef, params),
        )

    @classmethod
    def abstract_state(cls, config, mesh):
        _, init_params = cls._graph(config)
        return abstract_train_state(init_params, config.optim, mesh)

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        graphdef, _ = cls._graph(config)
        return nnx.merge(graphdef, params)

    def run_facts(self, steps, state) -> dict:
        b, h = self.config.data.batch_size, self.config.model.hidden
        return {
            "param_count": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "shapes": {"batch": b, "features": 64, "hidden": h, "classes": 10},
            "work": {"unit": "images", "per_step": b},
        }


# --- Counter: no training iterator; a counter in the state is its data -------------------------


class CounterState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    counter: jax.Array  # int32: where the data stream is; advanced by the step, saved with it


COUNTER_START = 7
SCALE = 1009  # the counter's rule: c -> (17 c + 5) mod 1009, a fixed walk over 0..1008


def _points(counter, batch: int):
    """The step's inputs and targets, from the counter alone: x in [0, 1), y = 3x - 1."""
    xs = ((counter + jnp.arange(batch)) * 37 % SCALE).astype(jnp.float32) / SCALE
    return jnp.stack([xs, xs * xs, jnp.ones_like(xs)], axis=1), 3.0 * xs - 1.0


@register_objective
class Counter(Objective):
    kind = "counter"

    def data(self) -> DataSource:
        x, y = _points(jnp.int32(0), 16)
        batch = {"x": np.asarray(x), "y": np.asarray(y)}
        return DataSource(
            train=None,
            eval_batches=[batch],
            identity=hashlib.sha256(f"counter {COUNTER_START} {SCALE}".encode()).hexdigest(),
            description={"data": f"a counter in the state, from {COUNTER_START}, mod {SCALE}"},
            eval_row_ids=lambda b: [str(i) for i in range(len(b["y"]))],
        )

    @classmethod
    def _start(cls, config):
        tx = optimizer(config.optim)

        def init():
            params = {"w": jnp.zeros((3,), jnp.float32)}
            return CounterState(
                jnp.zeros((), jnp.int32),
                params,
                tx.init(params),
                jax.random.PRNGKey(config.seed),
                jnp.int32(COUNTER_START),
            )

        return tx, init

    @classmethod
    def abstract_state(cls, config, mesh):
        _, init = cls._start(config)
        shapes = jax.eval_shape(init)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            sharding.state_shardings(shapes, mesh),
        )

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        return lambda x: x @ params["w"]

    def steps(self, mesh) -> Steps:
        tx, init = self._start(self.config)
        batch = self.config.data.batch_size
        shapes = jax.eval_shape(init)
        state_sharding = sharding.state_shardings(shapes, mesh)
        replicated = NamedSharding(mesh, P())
        batch_sharding = NamedSharding(mesh, sharding.BATCH_SPEC)

        def loss(params, x, y):
            return jnp.mean((x @ params["w"] - y) ** 2)

        def train(state, frozen, _batch):
            x, y = _points(state.counter, batch)
            value, grads = jax.value_and_grad(loss)(state.params, x, y)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            rng, _ = jax.random.split(state.rng)
            counter = (17 * state.counter + 5) % SCALE
            new = CounterState(state.step + 1, params, opt_state, rng, counter)
            return new, {"loss": value, "counter": state.counter}

        def evaluate(params, frozen, b):
            err = (b["x"] @ params["w"] - b["y"]) ** 2
            return {"val_loss": (err.sum(), jnp.float32(err.shape[0]))}

        return Steps(
            graphdef=None,
            tx=tx,
            mesh=mesh,
            init=jax.jit(init, out_shardings=state_sharding),
            train=Bound(
                jax.jit(
                    train,
                    in_shardings=(state_sharding, None, batch_sharding),
                    out_shardings=(state_sharding, replicated),
                    donate_argnums=0,
                ),
                None,
            ),
            eval=Bound(jax.jit(evaluate, out_shardings=replicated), None),
            state_sharding=state_sharding,
            batch_sharding=batch_sharding,
            all_finite=jax.jit(tree_all_finite, out_shardings=replicated),
            model=lambda params: self.model_from_params(self.config, params),
            state_shapes=shapes,
        )

    def run_facts(self, steps, state) -> dict:
        b = self.config.data.batch_size
        return {
            "param_count": 3,
            "shapes": {"batch": b, "features": 3},
            "work": {"unit": "counter points", "per_step": b},
        }
