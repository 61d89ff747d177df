"""A reward-model run dir for the PPO tests, and a language model of another shape or tokenizer
for the refusals of the PPO and DPO tests, written through the checkpoint store.

The reward objective (``objective.kind: reward``) is built elsewhere; until it lands these tests
write its checkpoint layout themselves, as ``tpulab.train.objectives.frozen.load_reward_model``
assumes it: a ``TrainState`` whose params are a ``ScalarHeadModel``'s (``body``: the SFT
Transformer, ``score``: Dense(d_model, 1) + bias, float32), its Adam state, and the run's config
(kind ``reward``), tokenizer and identities in the metadata.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from tpulab.checkpoint.store import CheckpointStore
from tpulab.config import to_dict
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.train.objectives.ppo_state import value_graph
from tpulab.train.restore import load_model
from tpulab.train.step import TrainState, make_mesh, make_steps, optimizer


def write_reward_model(
    base_run: Path, out: Path, *, seed: int = 0, kind: str = "reward", tokenizer=TOKENIZER
) -> Path:
    """A reward model on ``base_run``'s Transformer with a seeded random head (std 0.5: scores
    that differ between replies), saved as step 1 of ``out``."""
    base = load_model(base_run)
    cfg = base.config
    _, abstract = value_graph(cfg)
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)
    params["body"] = jax.device_get(base.plain_params())
    rng = np.random.default_rng(seed)
    params["score"]["kernel"][...] = rng.normal(0, 0.5, (cfg.model.d_model, 1)).astype(np.float32)
    params["score"]["bias"][...] = np.full((1,), 0.1, np.float32)
    state = TrainState(
        jnp.ones((), jnp.int32), params, optimizer(cfg.optim).init(params), jax.random.PRNGKey(0)
    )
    config = copy.deepcopy(to_dict(cfg))
    config["objective"]["kind"] = kind
    meta = {
        "config": config,
        "tokenizer": tokenizer,
        "identities": {"base": base.checkpoint_digest},
        "corpus_identity": "n/a (a test's reward model)",
    }
    return save_checkpoint(out, 1, state, meta)


def write_lm(base: Path, out: Path, *, tokenizer=TOKENIZER, **model) -> Path:
    """A language-model checkpoint like ``base``'s (or a fresh, untrained one of another shape)
    through the store, with the given tokenizer definition in its metadata."""
    restored = load_model(base)
    cfg = tiny_config(*(f"model.{k}={v}" for k, v in model.items()))
    state = restored.state if not model else make_steps(cfg, make_mesh()).init()
    meta = {"config": to_dict(cfg), "tokenizer": tokenizer, "identities": {}}
    return save_checkpoint(out, 40, state, meta)


def save_checkpoint(out: Path, step: int, state: TrainState, meta: dict) -> Path:
    """``state`` as the committed checkpoint ``step`` of run dir ``out``, through the store (its
    manifest and digests, as the trainer writes them), synchronously."""
    store = CheckpointStore(out / "checkpoints", keep=2, async_save=False)
    try:
        store.save(step, state, None, meta)
        store.wait()
    finally:
        store.close()
    return out


def ppo_sets(init: Path, reward: Path, *extra: str) -> list[str]:
    """The tiny PPO run of these tests, as --set overrides: rounds of 8 rollouts of at most 8 new
    bytes, 2 epochs x 2 minibatches (4 steps a round), 3 rounds. Synchronous saves: a kill after
    step 7 must find step 6 committed (an async save still in flight at the kill made a first
    attempt resume from step 3), and one config lets the proofs reuse ``ppo_run``."""
    return [
        "objective.kind=ppo",
        f"objective.init={init}",
        f"objective.reward_model={reward}",
        "objective.ppo.rollouts=8",
        "objective.ppo.max_new=8",
        "objective.ppo.epochs=2",
        "objective.ppo.minibatches=2",
        "data.batch_size=4",
        "train.steps=12",
        "train.eval_every=4",
        "train.eval_batches=1",
        "checkpoint.save_every=3",
        "checkpoint.async_save=false",
        *extra,
    ]


def ppo_config(init: Path, reward: Path, *extra: str):
    return tiny_config(*ppo_sets(init, reward, *extra))
