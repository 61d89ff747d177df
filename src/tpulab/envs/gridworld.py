"""A small deterministic gridworld with a time limit, where reaching the goal (terminated) and
running out of time (truncated) are different events a test can count exactly."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpulab.envs.base import Environment, register
from tpulab.errors import ConfigError

# Actions 0..3: up, right, down, left, as (row, column) moves.
MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))


class GridParams(NamedTuple):
    max_steps: int = 20
    goal_reward: float = 1.0
    step_reward: float = 0.0


class GridState(NamedTuple):
    pos: jax.Array  # (row, column), int32
    time: jax.Array  # steps taken in this episode (int32)


@register("gridworld")
@dataclasses.dataclass(frozen=True)
class GridWorld(Environment):
    """``size`` x ``size`` cells; the agent starts in the top-left corner, the goal is the
    bottom-right one; moves into a wall leave the agent in place. Observation: the one-hot cell."""

    size: int = 5
    num_actions = 4

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 2:
            raise ConfigError(f"gridworld size must be an integer >= 2, got {self.size!r}")

    def default_params(self) -> GridParams:
        return GridParams()

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.size * self.size,)

    def observe(self, state: GridState) -> jax.Array:
        cell = state.pos[0] * self.size + state.pos[1]
        return jax.nn.one_hot(cell, self.size * self.size, dtype=jnp.float32)

    def reset_env(self, key: jax.Array, params: GridParams):
        del key  # a fixed start: the counts of the tests are exact
        state = GridState(jnp.zeros((2,), jnp.int32), jnp.zeros((), jnp.int32))
        return self.observe(state), state

    def step_env(self, key: jax.Array, state: GridState, action, params: GridParams):
        del key
        move = jnp.asarray(MOVES, jnp.int32)[action]
        pos = jnp.clip(state.pos + move, 0, self.size - 1)
        state = GridState(pos, state.time + 1)
        terminated = jnp.all(pos == self.size - 1)
        truncated = (state.time >= params.max_steps) & ~terminated
        reward = jnp.where(terminated, params.goal_reward, params.step_reward).astype(jnp.float32)
        return self.observe(state), state, reward, terminated, truncated
