"""PPO's checkpointed state: the loop's four fields and the round in progress, from the config.

Apart from ``objectives.ppo`` so that ``tpulab.train.restore`` can rebuild the state's shapes (a
proof's whole-state verdict, ``generate`` on a PPO run) without reading the runs it started from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tpulab.model.transformer import Transformer
from tpulab.model.value import scalar_head_graph
from tpulab.train import sharding
from tpulab.train.config import RunConfig
from tpulab.train.step import initial_state, optimizer


class RoundState(NamedTuple):
    """A round's rollouts and everything computed from them, with where the round stands: what a
    kill in the middle of a round must get back. Per-token arrays are [N, T] over target positions
    (target t is token t + 1), 0 off the reply."""

    tokens: jax.Array  # [N, T + 1] int32: BOS SOH prompt STX reply, PAD after
    mask: jax.Array  # [N, T] float32: 1 on the reply's tokens (its stop byte included)
    old_logp: jax.Array  # [N, T] the trainer's log-probs under the behaviour policy (at t)
    sampler_logp: jax.Array  # [N, T] the sampler's own log-probs of the tokens it drew
    old_values: jax.Array  # [N, T] the value head under the behaviour policy
    ref_logp: jax.Array  # [N, T] the frozen reference's log-probs (at t)
    rewards: jax.Array  # [N, T] -kl_coef * KL, plus the reward-model score at the last token
    advantages: jax.Array  # [N, T] GAE, whitened over the round
    returns: jax.Array  # [N, T] GAE + old value: the value target
    score: jax.Array  # [N] float32: the reward model's score at the last reply byte (proxy)
    length: jax.Array  # [N] int32: reply tokens sampled
    sample_key: jax.Array  # uint32[2]: the key the round's replies were drawn with
    perm_key: jax.Array  # uint32[2]: epoch e's minibatch order is permutation(fold_in(key, e))
    position: jax.Array  # int32: the next update's index in the round, 0 .. epochs*minibatches-1
    index: jax.Array  # int32: rounds started so far (1 for the first round)
    behaviour_sha256: jax.Array  # uint32[8]: sha256 of the policy weights that sampled the round


class PPOState(NamedTuple):
    step: jax.Array
    params: Any  # nnx.State of ScalarHeadModel: the policy (body) and its value head (score)
    opt_state: Any
    rng: jax.Array  # uint32[2]: split at every round start (sampler and minibatch keys)
    round: RoundState


@dataclasses.dataclass(frozen=True)
class Sizes:
    prompts: int  # B: prompts per round (data.batch_size)
    rollouts: int  # N
    repeat: int  # N / B: replies per prompt
    minibatches: int  # M
    minibatch: int  # N / M rows per update
    epochs: int  # E
    per_round: int  # K = E * M loop steps per round
    seq: int  # T: data.seq_len
    width: int  # W = T - max_new: the widest prompt (BOS SOH prompt STX)
    max_new: int

    @classmethod
    def of(cls, config: RunConfig) -> Sizes:
        p, b = config.objective.ppo, config.data.batch_size
        return cls(
            prompts=b,
            rollouts=p.rollouts,
            repeat=p.rollouts // b,
            minibatches=p.minibatches,
            minibatch=p.rollouts // p.minibatches,
            epochs=p.epochs,
            per_round=p.steps_per_round,
            seq=config.data.seq_len,
            width=config.data.seq_len - p.max_new,
            max_new=p.max_new,
        )


def empty_round(z: Sizes) -> RoundState:
    """The state before the first round (position 0: the next step starts a round)."""
    n, t = z.rollouts, z.seq
    f = jnp.zeros((n, t), jnp.float32)
    key = jnp.zeros((2,), jnp.uint32)
    return RoundState(
        tokens=jnp.zeros((n, t + 1), jnp.int32),
        mask=f,
        old_logp=f,
        sampler_logp=f,
        old_values=f,
        ref_logp=f,
        rewards=f,
        advantages=f,
        returns=f,
        score=jnp.zeros((n,), jnp.float32),
        length=jnp.zeros((n,), jnp.int32),
        sample_key=key,
        perm_key=key,
        position=jnp.zeros((), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        behaviour_sha256=jnp.zeros((8,), jnp.uint32),
    )


def value_graph(config: RunConfig) -> tuple[Any, Any]:
    """(graphdef, abstract params) of the policy with its value head: a reward model's layout
    (``ScalarHeadModel``); PPO starts the head at zero (``ppo.PPO._start_params``)."""
    graphdef, abstract, _ = scalar_head_graph(config.model, config.precision, config.seed)
    return graphdef, abstract


def body_graph(config: RunConfig) -> Any:
    """The graphdef of a plain Transformer of this run's shape (the reference, the policy body)."""
    model = nnx.eval_shape(
        lambda: Transformer(config.model, config.precision, rngs=nnx.Rngs(params=config.seed))
    )
    return nnx.split(model)[0]


def start_state(config: RunConfig, params) -> PPOState:
    """The state at step 0 from the policy's starting parameters (traced inside the init): every
    objective's four fields, then the empty round."""
    first = initial_state(optimizer(config.optim), params, config.seed)
    return PPOState(*first, round=empty_round(Sizes.of(config)))


def abstract_state(config: RunConfig, mesh: Mesh) -> PPOState:
    """Shapes, dtypes and shardings of the state (a restore target), from the config alone."""
    _, params = value_graph(config)
    return sharding.placed_shapes(jax.eval_shape(lambda: start_state(config, params)), mesh)


def policy_module(config: RunConfig, params) -> Transformer:
    """The trained language model alone (the value head left out): what generates from a PPO run."""
    return nnx.merge(body_graph(config), params["body"])
