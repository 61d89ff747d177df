"""The pure training and evaluation steps.

``TrainState`` is the whole training state as one pytree: step, parameters, optimizer state
(both Adam moments and the count) and the dropout RNG key, which is split every step and
carried, like a torch generator, so it must come back on resume for the masks to match.
Steps are built once per run (``make_steps``) and jitted with explicit shardings from the one table in
``tpulab.train.sharding`` (parameters and Adam moments over ``fsdp``, the batch over ``data`` x ``fsdp``),
so the same code runs on one CPU, several devices or several processes. The train step donates the
incoming state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab.model.transformer import Transformer
from tpulab.train import sharding
from tpulab.train.config import OptimConfig, RunConfig
from tpulab.train.sharding import DATA_AXIS  # noqa: F401 - re-exported for older callers


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied so far
    params: Any  # nnx.State of the model's nnx.Param leaves
    opt_state: Any  # optax state: clip, Adam (count, mu, nu)
    rng: jax.Array  # uint32[2] dropout key, split once per step


def masked_xent(
    logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(mean NLL over valid targets, number of valid targets). Padded targets contribute exactly zero."""
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    nll_bt = -jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    count = jnp.sum(mask_bt)
    total = jnp.sum(jnp.where(mask_bt > 0, nll_bt, 0.0))
    return total / jnp.maximum(count, 1.0), count


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, cfg.schedule_steps, end_value=cfg.lr * cfg.min_lr_ratio
    )


def optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(
        lr_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    return (
        optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
    )


def tree_all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite (integer leaves always are)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_mesh(config: RunConfig | None = None) -> Mesh:
    return sharding.make_mesh(config.mesh if config is not None else None)


@dataclasses.dataclass(frozen=True)
class Steps:
    """Everything a run needs to compute: built once, each function jitted once."""

    graphdef: Any
    tx: optax.GradientTransformation
    mesh: Mesh
    init: Any  # () -> TrainState
    train: Any  # (state, batch) -> (state, metrics); donates state
    eval: Any  # (params, batch) -> (nll_sum, count)
    state_sharding: Any
    batch_sharding: NamedSharding
    all_finite: Any  # (state) -> bool scalar: every leaf finite (checked before a state is saved)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state without computing it (the restore target)."""
        shapes = jax.eval_shape(self.init)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            self.state_sharding,
        )

    def model(self, params) -> Transformer:
        return nnx.merge(self.graphdef, params)

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of the global batch (all rows on one process) -> global arrays."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in batch.items()
        }

    def put_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A batch every process holds whole (validation) -> global arrays; each device takes its rows."""
        return {
            k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda idx, v=v: v[idx])
            for k, v in batch.items()
        }


def make_steps(config: RunConfig, mesh: Mesh | None = None) -> Steps:
    mesh = mesh or make_mesh(config)
    sharding.check_batch(config.data.batch_size, mesh)
    tx = optimizer(config.optim)
    schedule = lr_schedule(config.optim)

    def build_model(seed: int) -> Transformer:
        return Transformer(config.model, config.precision, rngs=nnx.Rngs(params=seed))

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(config.seed)))

    def init() -> TrainState:
        _, params = nnx.split(build_model(config.seed))
        rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng)

    def loss_fn(params, batch, dropout_key):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"], deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
        return masked_xent(logits, batch["targets"], batch["mask"])

    def train_step(state: TrainState, batch):
        rng, dropout_key = jax.random.split(state.rng)
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, dropout_key
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
            "tokens": count,
        }
        return TrainState(state.step + 1, params, opt_state, rng), metrics

    def eval_step(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"], deterministic=True)
        mean, count = masked_xent(logits, batch["targets"], batch["mask"])
        return mean * count, count

    replicated = NamedSharding(mesh, P())
    state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh)
    batch_sharding = NamedSharding(mesh, sharding.BATCH_SPEC)
    return Steps(
        graphdef=graphdef,
        tx=tx,
        mesh=mesh,
        init=jax.jit(init, out_shardings=state_sharding),
        train=jax.jit(
            train_step,
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, replicated),
            donate_argnums=0,
        ),
        eval=jax.jit(
            eval_step,
            in_shardings=(state_sharding.params, batch_sharding),
            out_shardings=replicated,
        ),
        state_sharding=state_sharding,
        batch_sharding=batch_sharding,
        all_finite=jax.jit(
            tree_all_finite, in_shardings=(state_sharding,), out_shardings=replicated
        ),
    )
