"""The functional environment API (gymnax's shape) and the registry of environment names.

An environment is a frozen dataclass whose fields are static (they fix shapes: a grid's size) and
whose dynamics are pure functions of an explicit key, a state pytree and a params pytree, so it can
be jitted, vmapped over environments and scanned over steps, and its state checkpointed as arrays.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tpulab.errors import ConfigError

_REGISTRY: dict[str, type[Environment]] = {}


class Environment:
    """Subclasses implement ``default_params``, ``reset_env`` and ``step_env`` (one episode, no
    reset); ``reset`` and ``step`` are the public API, with auto-reset.

    ``step`` returns ``(obs, state, reward, terminated, truncated, info)``. ``terminated``: the
    episode reached a terminal state (no value beyond it). ``truncated``: the time limit cut it off
    and it did not terminate on that step, so the two are never both true and a learner bootstraps
    exactly on the truncated transitions. On either, ``obs`` and ``state`` already belong to a fresh
    episode and ``info["final_obs"]`` holds the last observation of the one that ended (equal to
    ``obs`` on every other step).
    """

    name: ClassVar[str]
    num_actions: ClassVar[int]

    def default_params(self) -> Any:
        raise NotImplementedError

    @property
    def obs_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def reset_env(self, key: jax.Array, params: Any) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def step_env(
        self, key: jax.Array, state: Any, action: jax.Array, params: Any
    ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array]:
        """One transition of the current episode: ``(obs, state, reward, terminated, truncated)``,
        with ``truncated`` already false where ``terminated`` is true."""
        raise NotImplementedError

    def reset(self, key: jax.Array, params: Any) -> tuple[jax.Array, Any]:
        return self.reset_env(key, params)

    def step(
        self, key: jax.Array, state: Any, action: jax.Array, params: Any
    ) -> tuple[jax.Array, Any, jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        key_step, key_reset = jax.random.split(key)
        obs, state, reward, terminated, truncated = self.step_env(key_step, state, action, params)
        # Both branches are computed and selected, as in gymnax: no Python control flow, so the
        # whole step stays one traced program under vmap and scan.
        obs_reset, state_reset = self.reset_env(key_reset, params)
        done = terminated | truncated
        new_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_reset, state)
        new_obs = jnp.where(done, obs_reset, obs)
        return new_obs, new_state, reward, terminated, truncated, {"final_obs": obs}


def register(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: the environment is made by ``make(name)``. The one line a new file adds."""

    def deco(cls: type[Environment]) -> type[Environment]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment name {name!r} registered twice")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            # Environments are static arguments of jitted rollouts: equal fields must hash equal.
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _discover() -> None:
    """Import every module of this package once, so each file's ``@register`` has run: a new
    environment needs no edit anywhere else."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")


def registered() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_REGISTRY))


def make(name: str, **options: Any) -> Environment:
    """The environment registered as ``name``, built with ``options`` (its static fields)."""
    names = registered()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown environment {name!r}; registered: {', '.join(names)}")
    cls = _REGISTRY[name]
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(
            f"environment {name!r} has no option {', '.join(unknown)}; "
            f"it takes: {', '.join(sorted(allowed)) or 'none'}"
        )
    return cls(**options)
