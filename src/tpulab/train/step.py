"""The pure training and evaluation steps, built once per run for any objective.

``TrainState`` is the whole training state as one pytree: step, the trained parameters, optimizer
state (both Adam moments and the count) and the dropout RNG key, which is split every step and
carried, like a torch generator, so it must come back on resume for the masks to match.
Every objective's steps are built from two pieces: ``Update`` (value and gradients of a loss, the
optimizer with its clipping, the step counted, the shared metrics) and ``compile_steps`` (every
function jitted once with explicit shardings from the one table in ``tpulab.train.sharding``:
parameters and Adam moments over ``fsdp``, the batch over ``data`` x ``fsdp``; the train step
donates the incoming state), so the same code runs on one CPU, several devices or several
processes. ``gradient_steps`` is one ``Update`` per batch (pretraining, SFT, LoRA, reward, DPO):
the objective gives the loss, the evaluation sums, what trains (the state's params) and what stays
frozen (passed to every step as an argument, never donated and never part of the optimizer state).
PPO drives the same ``Update`` from its rollouts and minibatches. ``make_steps`` is pretraining's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
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


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied so far
    params: Any  # nnx.State of the model's nnx.Param leaves
    opt_state: Any  # optax state: clip, Adam (count, mu, nu)
    rng: jax.Array  # uint32[2] dropout key, split once per step


def masked_xent(
    logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(mean NLL over valid targets, number of valid targets); masked targets contribute exactly 0.

    Under jit with a sharded batch both sums run over the global batch (every device and process),
    so the mean is over all valid targets of the step, never averaged per row or per device.
    """
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    nll_bt = -jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    count = jnp.sum(mask_bt)
    total = jnp.sum(jnp.where(mask_bt > 0, nll_bt, 0.0))
    return total / jnp.maximum(count, 1.0), count


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0, then a cosine or linear decay to ``min_lr_ratio * lr`` at
    ``schedule_steps``; with ``decay_every`` k > 1, step s reads the schedule at s - s % k
    (cleanrl's PPO: lr * (1 - (update - 1) / updates), constant over an update's minibatches)."""
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        base = optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, cfg.warmup_steps, cfg.schedule_steps, end_value=end
        )
    else:
        base = optax.linear_schedule(cfg.lr, end, cfg.schedule_steps - cfg.warmup_steps)
        if cfg.warmup_steps:
            warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
            base = optax.join_schedules([warmup, base], [cfg.warmup_steps])
    if cfg.decay_every == 1:
        return base
    k = cfg.decay_every
    return lambda step: base(step - step % k)


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


def tree_digest(tree) -> str:
    """sha256 over every leaf's dtype, shape and bytes in tree order: one name for exact weights."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        a = np.asarray(leaf)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def digest_words(hexdigest: str) -> np.ndarray:
    """A sha256 hex digest as uint32[8] (big-endian words): a digest a jitted step can carry in
    its state and return as a metric."""
    return np.frombuffer(bytes.fromhex(hexdigest), ">u4").astype(np.uint32)


def words_digest(words) -> str:
    """``digest_words`` reversed: uint32[8] -> the hex digest."""
    return np.asarray(words, np.uint32).astype(">u4").tobytes().hex()


def make_mesh(config: RunConfig | None = None) -> Mesh:
    return sharding.make_mesh(config.mesh if config is not None else None)


@dataclasses.dataclass(frozen=True)
class Steps:
    """Everything a run needs to compute: built once, each function jitted once."""

    graphdef: Any
    tx: optax.GradientTransformation
    mesh: Mesh
    init: Any  # () -> TrainState
    train: Bound  # (state, batch) -> (state, metrics); donates state
    eval: Bound  # (params, batch) -> {name: (sum, weight)}: the loop reports sum / weight per name
    state_sharding: Any
    batch_sharding: NamedSharding
    all_finite: Any  # (state) -> bool scalar: every leaf finite (checked before a state is saved)
    model: Callable[[Any], nnx.Module]  # trained params -> the model they run in (frozen included)
    frozen: Any = None  # arrays every step reads and none changes (a LoRA base); None for most
    state_shapes: Any = None  # jax.eval_shape of the state, when init reads a checkpoint

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state without computing (or reading) it: the
        restore target."""
        shapes = self.state_shapes if self.state_shapes is not None else jax.eval_shape(self.init)
        return sharding.placed_shapes(shapes, self.mesh, self.state_sharding)

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of the global batch (all rows on one process) -> global arrays."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in batch.items()
        }

    def put_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A batch every process holds whole (validation) -> global arrays; devices take rows."""
        return {
            k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda idx, v=v: v[idx])
            for k, v in batch.items()
        }


@dataclasses.dataclass(frozen=True)
class Bound:
    """A jitted ``fn(first, frozen, *rest)`` called as ``(first, *rest)``: the frozen arrays are an
    argument of the program, not constants baked into it, and stay inspectable (``lower``)."""

    fn: Any
    frozen: Any

    def __call__(self, first, *rest):
        return self.fn(first, self.frozen, *rest)

    def lower(self, first, *rest):
        return self.fn.lower(first, self.frozen, *rest)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


Loss = Callable[[Any, Any, dict, jax.Array], tuple[jax.Array, dict]]
Eval = Callable[[Any, Any, dict], dict[str, tuple[jax.Array, jax.Array]]]


def initial_state(tx: optax.GradientTransformation, params, seed: int) -> TrainState:
    """Step 0 of any objective's state: ``params``, a fresh optimizer state and the run's key
    (``fold_in(PRNGKey(seed), 1)``); a state with more fields (PPO's round) extends these four."""
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng)


def step_keys(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the key carried to the next step, the key this step's loss is given): the one split of
    the state's key per ``gradient_steps`` step, so an audit can recompute step 1's from step 0's
    state (masks drawn from it, dropout)."""
    carried, loss_key = jax.random.split(rng)
    return carried, loss_key


def input_gradients(fn: Callable[..., jax.Array], *inputs) -> tuple:
    """The gradient of the scalar ``fn(*inputs)`` with respect to each of its inputs (never the
    parameters, no optimizer): what an audit reads to see which inputs a loss depends on."""
    return jax.grad(fn, argnums=tuple(range(len(inputs))))(*inputs)


@dataclasses.dataclass(frozen=True)
class Update:
    """One optimizer step on a loss: the piece every objective's train step is built from.

    ``loss(params, *args) -> (loss, metrics)``; ``update(state, *args) -> (state, metrics)`` takes
    its value and gradients, applies the run's optimizer (``optimizer``: global-norm clipping, then
    AdamW on the schedule) and counts the step; the record is ``loss``, ``grad_norm``, ``lr`` and
    the loss's own metrics. ``state`` is any NamedTuple with ``step``, ``params`` and
    ``opt_state``; its other fields (the key, PPO's round) are the caller's to carry.
    """

    loss: Callable[..., tuple[jax.Array, dict]]
    tx: optax.GradientTransformation
    schedule: optax.Schedule

    @classmethod
    def of(cls, loss: Callable[..., tuple[jax.Array, dict]], optim: OptimConfig) -> Update:
        return cls(loss, optimizer(optim), lr_schedule(optim))

    def __call__(self, state, *args):
        (value, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(state.params, *args)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": value,
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state.step),
            **aux,
        }
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def compile_steps(
    *,
    mesh: Mesh,
    graphdef: Any,
    tx: optax.GradientTransformation,
    start: Callable[[Any], Any],
    train_step: Callable[..., tuple[Any, dict]],
    evaluate: Callable[..., Any],
    merge: Callable[[Any, Any], nnx.Module],
    init_params: Callable[[], Any] | None = None,
    load_params: Callable[[], Any] | None = None,
    frozen: Any = None,
    host_args: int = 0,
    host_train: Callable[[Any], Any] | None = None,
    host_eval: Callable[[Any], Any] | None = None,
    shapes: Any = None,
) -> Steps:
    """Every objective's steps, jitted once with shardings from the one table
    (``tpulab.train.sharding``): the state's (``shapes``, from ``jax.eval_shape``; by default
    ``start(init_params())``'s, traced), the batch's
    over ``data`` x ``fsdp``, the frozen arrays' by the state's rules; the train step donates the
    incoming state; ``all_finite`` is the loop's guard before a state is saved.

    ``train_step(state, frozen, batch, *extra)`` with ``host_args`` extra replicated arguments
    (PPO's behaviour digest); ``evaluate(params, frozen, batch)``; ``start(params) -> state``, run
    inside the init program on ``init_params()`` (traced: a random init) or on ``load_params()``
    (host arrays, read each time the state is initialised, so no caller's buffer is donated).
    ``host_train`` / ``host_eval`` wrap a jitted function with the host work around it (PPO's
    digest at a round start, its gold reward).
    """
    replicated = NamedSharding(mesh, P())
    if shapes is None:
        shapes = jax.eval_shape(lambda: start(init_params()))
    state_sharding = sharding.state_shardings(shapes, mesh)
    batch_sharding = NamedSharding(mesh, sharding.BATCH_SPEC)
    frozen_sharding = sharding.state_shardings(frozen, mesh) if frozen is not None else None
    if frozen is not None:
        frozen = jax.device_put(frozen, frozen_sharding)
    if load_params is None:
        init = jax.jit(lambda: start(init_params()), out_shardings=state_sharding)
    else:
        started = jax.jit(
            start, in_shardings=(state_sharding.params,), out_shardings=state_sharding
        )
        init = lambda: started(load_params())  # noqa: E731
    train = jax.jit(
        train_step,
        in_shardings=(state_sharding, frozen_sharding, batch_sharding) + (replicated,) * host_args,
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )
    evaluation = jax.jit(
        evaluate,
        in_shardings=(state_sharding.params, frozen_sharding, batch_sharding),
        out_shardings=replicated,
    )
    return Steps(
        graphdef=graphdef,
        tx=tx,
        mesh=mesh,
        init=init,
        train=Bound(host_train(train) if host_train else train, frozen),
        eval=Bound(host_eval(evaluation) if host_eval else evaluation, frozen),
        state_sharding=state_sharding,
        batch_sharding=batch_sharding,
        all_finite=jax.jit(
            tree_all_finite, in_shardings=(state_sharding,), out_shardings=replicated
        ),
        model=lambda params: merge(params, frozen),
        frozen=frozen,
        state_shapes=shapes,
    )


@dataclasses.dataclass(frozen=True)
class Carried:
    """What a one-loss objective's state carries beyond ``TrainState``'s fields (masked bytes: the
    key its masks are drawn from), for ``gradient_steps``: ``start(state) -> state`` extends the
    step-0 ``TrainState`` (into a NamedTuple with more fields); ``prepare(state, batch) -> (state,
    batch)`` runs first in every train step (draws what the step needs, advances what it carries).
    """

    start: Callable[[TrainState], Any]
    prepare: Callable[[Any, dict], tuple[Any, dict]]


def gradient_steps(
    config: RunConfig,
    mesh: Mesh,
    *,
    graphdef: Any,
    init_params: Callable[[], Any],
    loss: Loss,
    evaluate: Eval,
    merge: Callable[[Any, Any], nnx.Module] | None = None,
    load_params: Callable[[], Any] | None = None,
    frozen: Any = None,
    carried: Carried | None = None,
) -> Steps:
    """The steps of an objective that takes one optimizer step on ``loss`` per batch, with the
    run's optimizer (``config.optim``) and key (``config.seed``).

    ``init_params()`` builds the trained parameters inside the init program (a random init); it
    also defines their structure. ``load_params()``, when given, supplies their starting values
    instead (a checkpoint's arrays). ``loss(params, frozen, batch, key) -> (loss, metrics)``: the
    metrics (device scalars) join ``loss``, ``grad_norm`` and ``lr`` in every step's record
    (``Update``). ``evaluate(params, frozen, batch) -> {name: (sum, weight)}``.
    ``merge(params, frozen)`` is the model those parameters run in (default: ``graphdef`` merged
    with both). ``frozen`` is placed with the same sharding rules as the state and passed to every
    step; its bytes never change (checked by the loop at the end of a run). The key is split every
    step: one half carried, one for dropout. ``carried``: a state with more fields (``Carried``).
    """
    update = Update.of(loss, config.optim)

    def start(params) -> TrainState:
        state = initial_state(update.tx, params, config.seed)
        return state if carried is None else carried.start(state)

    def train_step(state: TrainState, frozen, batch):
        if carried is not None:
            state, batch = carried.prepare(state, batch)
        rng, dropout_key = step_keys(state.rng)
        return update(state._replace(rng=rng), frozen, batch, dropout_key)

    return compile_steps(
        mesh=mesh,
        graphdef=graphdef,
        tx=update.tx,
        start=start,
        train_step=train_step,
        evaluate=evaluate,
        merge=merge or (lambda params, frozen: merge_model(graphdef, params, frozen)),
        init_params=init_params,
        load_params=load_params,
        frozen=frozen,
    )


def lm_steps(config: RunConfig, mesh: Mesh, graphdef, init_params, **kwargs) -> Steps:
    """A language model's steps: ``gradient_steps`` on the masked next-token loss of ``graphdef``
    and its ``val_loss`` (pretraining, SFT and LoRA; ``kwargs``: ``load_params``, ``frozen``)."""
    return gradient_steps(
        config,
        mesh,
        graphdef=graphdef,
        init_params=init_params,
        loss=lm_loss(graphdef),
        evaluate=lm_eval(graphdef),
        **kwargs,
    )


def lm_loss(graphdef) -> Loss:
    """Masked next-token cross-entropy of the Transformer ``graphdef`` (params and frozen merged):
    pretraining's loss, and SFT's, whose masks cover the response bytes only."""

    def loss(params, frozen, batch, dropout_key):
        model = merge_model(graphdef, params, frozen)
        logits = model(batch["inputs"], deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
        value, count = masked_xent(logits, batch["targets"], batch["mask"])
        return value, {"tokens": count.astype(jnp.int32)}  # targets in the loss: a count

    return loss


def lm_eval(graphdef) -> Eval:
    """``val_loss``: the masked NLL summed over the batch, with its target count as the weight."""

    def evaluate(params, frozen, batch):
        logits = merge_model(graphdef, params, frozen)(batch["inputs"], deterministic=True)
        mean, count = masked_xent(logits, batch["targets"], batch["mask"])
        return {"val_loss": (mean * count, count)}

    return evaluate


def merge_model(graphdef, params, frozen=None) -> nnx.Module:
    """The module of ``graphdef`` with its trained and (when any) frozen variables."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def transformer_graph(config: RunConfig) -> tuple[Any, Callable[[], Any]]:
    """(graphdef, init_params) of the run's Transformer: its structure, and a random init from the
    run's seed (traced inside the init program)."""

    def build_model() -> Transformer:
        return Transformer(config.model, config.precision, rngs=nnx.Rngs(params=config.seed))

    graphdef, _ = nnx.split(nnx.eval_shape(build_model))
    return graphdef, lambda: nnx.split(build_model())[1]


def make_steps(config: RunConfig, mesh: Mesh | None = None) -> Steps:
    """Pretraining's steps: the Transformer from a random init, every parameter trained."""
    mesh = mesh or make_mesh(config)
    sharding.check_batch(config.data.batch_size, mesh)
    return lm_steps(config, mesh, *transformer_graph(config))
