"""The models a post-training run reads from other run dirs, and the one check that they fit it.

SFT, DPO and the reward model start from ``objective.init``; DPO and PPO hold a reference fixed
(``objective.reference``, default: init) and PPO a reward model (``objective.reward_model``). Each
is read here, as a fresh host copy named by its checkpoint's manifest digest, and each must have
this run's model shape, precision and tokenizer (``check_same_model``, the one place that says
what "the same model" means).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab.checkpoint.files import manifest_digest
from tpulab.checkpoint.store import read_meta, read_state
from tpulab.config import from_dict
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import TpulabError
from tpulab.train import sharding
from tpulab.train.config import OptimConfig, RunConfig
from tpulab.train.objectives.lm import LANGUAGE_MODEL, REWARD_MODEL
from tpulab.train.objectives.ppo_state import value_graph
from tpulab.train.registry import objective_class
from tpulab.train.restore import Restored, checkpoint_dir, load_model
from tpulab.train.step import TrainState, optimizer


def check_same_model(what: str, path, meta: dict, config: RunConfig) -> None:
    """The checkpoint whose metadata is ``meta`` must hold a model of this run's tokenizer, shape
    and precision. ``model.remat`` is not compared: rematerialisation changes what a backward pass
    keeps in memory, not the parameters or what the model computes, so a model trained with one
    setting is the same model under another. Fields the saved config lacks take their defaults."""
    if meta.get("tokenizer") != TOKENIZER:
        raise TpulabError(f"{what} {path} was trained with another tokenizer")
    saved = meta.get("config", {})
    for section in ("model", "precision"):
        want = getattr(config, section)
        have = from_dict(type(want), saved.get(section, {}))
        if section == "model":
            have = dataclasses.replace(have, remat=want.remat)
        diff = [
            f"{section}.{f.name}: {getattr(have, f.name)!r} there, {getattr(want, f.name)!r} here"
            for f in dataclasses.fields(want)
            if getattr(have, f.name) != getattr(want, f.name)
        ]
        if diff:
            raise TpulabError(
                f"{what} {path} holds a model of another shape ({'; '.join(diff[:3])})"
            )


def load_base(config: RunConfig, key: str = "init") -> Restored:
    """The language model ``objective.<key>`` names (init; a DPO or PPO reference, default:
    init), which must have this run's shape, precision and tokenizer."""
    init = getattr(config.objective, key) or config.objective.init
    base = load_model(init)
    produces = objective_class(base.config.objective.kind).produces
    if produces != LANGUAGE_MODEL:
        raise TpulabError(f"objective.{key} {init} is a {produces}, not a {LANGUAGE_MODEL}")
    check_same_model(f"objective.{key}", init, read_meta(base.checkpoint_dir), config)
    return base


@dataclasses.dataclass(frozen=True)
class Frozen:
    params: object  # host arrays
    digest: str  # sha256 of the checkpoint's manifest
    record: dict


def named(key: str, load):
    """``load()``, with a refusal naming the field that pointed at the bad run dir."""
    try:
        return load()
    except TpulabError as e:
        if str(e).startswith(f"objective.{key}"):
            raise
        raise type(e)(f"objective.{key}: {e}", exit_code=e.exit_code) from None


def load_reward_model(config: RunConfig) -> Frozen:
    """The frozen reward model ``objective.reward_model`` names: the one place that reads one.

    Assumed layout (the reward objective's, ``objective.kind: reward``): an ordinary run dir whose
    newest verified checkpoint holds a ``TrainState`` whose params are a ``ScalarHeadModel``'s,
    ``{"body": Transformer, "score": {"kernel": [d_model, 1], "bias": [1]}}`` in float32 for the
    head, the optimizer state of its own ``optim`` config, and the run's config, tokenizer and
    identities in the checkpoint metadata."""
    path = config.objective.reward_model
    step_dir = named("reward_model", lambda: checkpoint_dir(path))
    meta = read_meta(step_dir)
    kind = meta.get("config", {}).get("objective", {}).get("kind")
    if not isinstance(kind, str) or objective_class(kind).produces != REWARD_MODEL:
        raise TpulabError(
            f"objective.reward_model {path} is not a reward model (objective.kind={kind})"
        )
    check_same_model("objective.reward_model", path, meta, config)
    optim = from_dict(OptimConfig, meta["config"].get("optim", {}))
    _, abstract_params = value_graph(config)
    tx = optimizer(optim)
    target = jax.eval_shape(
        lambda: TrainState(
            jnp.zeros((), jnp.int32),
            abstract_params,
            tx.init(abstract_params),
            jax.random.PRNGKey(0),
        )
    )
    replicated = NamedSharding(sharding.make_mesh(), P())
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), target
    )
    state = read_state(step_dir, target)
    digest = manifest_digest(step_dir)
    record = {"run_dir": str(path), "step": int(step_dir.name), "checkpoint_digest": digest}
    return Frozen(jax.device_get(state.params), digest, record)


def model_record(config: RunConfig, key: str, restored: Restored) -> dict:
    """What a run records (documents.json) of the model ``objective.<key>`` names."""
    return {
        "run_dir": str(getattr(config.objective, key) or config.objective.init),
        "step": restored.step,
        "checkpoint_digest": restored.checkpoint_digest,
    }


def load_language_model(config: RunConfig, key: str) -> Frozen:
    """A fresh host copy of the language model ``objective.<key>`` names (init, reference)."""
    restored = named(key, lambda: load_base(config, key))
    record = model_record(config, key, restored)
    return Frozen(jax.device_get(restored.plain_params()), restored.checkpoint_digest, record)
