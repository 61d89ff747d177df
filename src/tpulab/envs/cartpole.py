"""CartPole-v1 as a pure function of (key, state, action, params): gymnasium's physics (Euler
integration, the same constants and thresholds, reward 1 per step, 500-step limit), float32."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpulab.envs.base import Environment, register


class CartPoleParams(NamedTuple):
    """Physics constants and limits; a pytree, so a perturbed copy is ``_replace(gravity=...)``."""

    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length, as in gymnasium
    force_mag: float = 10.0
    tau: float = 0.02  # seconds per step
    theta_threshold: float = 12 * 2 * math.pi / 360
    x_threshold: float = 2.4
    max_steps: int = 500


class CartPoleState(NamedTuple):
    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array
    time: jax.Array  # steps taken in this episode (int32)


@register("cartpole")
@dataclasses.dataclass(frozen=True)
class CartPole(Environment):
    num_actions = 2

    def default_params(self) -> CartPoleParams:
        return CartPoleParams()

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (4,)

    @staticmethod
    def observe(state: CartPoleState) -> jax.Array:
        return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot])

    def reset_env(self, key: jax.Array, params: CartPoleParams):
        x, x_dot, theta, theta_dot = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
        state = CartPoleState(x, x_dot, theta, theta_dot, jnp.zeros((), jnp.int32))
        return self.observe(state), state

    def step_env(self, key: jax.Array, state: CartPoleState, action, params: CartPoleParams):
        del key  # deterministic dynamics
        p = params
        force = jnp.where(action == 1, p.force_mag, -p.force_mag)
        cos, sin = jnp.cos(state.theta), jnp.sin(state.theta)
        total_mass = p.masspole + p.masscart
        polemass_length = p.masspole * p.length
        temp = (force + polemass_length * state.theta_dot**2 * sin) / total_mass
        theta_acc = (p.gravity * sin - cos * temp) / (
            p.length * (4.0 / 3.0 - p.masspole * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        # Explicit Euler: positions move with the old velocities (gymnasium's default integrator).
        state = CartPoleState(
            x=state.x + p.tau * state.x_dot,
            x_dot=state.x_dot + p.tau * x_acc,
            theta=state.theta + p.tau * state.theta_dot,
            theta_dot=state.theta_dot + p.tau * theta_acc,
            time=state.time + 1,
        )
        terminated = (jnp.abs(state.x) > p.x_threshold) | (jnp.abs(state.theta) > p.theta_threshold)
        truncated = (state.time >= p.max_steps) & ~terminated
        # Reward 1 on every step, the terminating one included (CartPole-v1).
        reward = jnp.ones((), jnp.float32)
        return self.observe(state), state, reward, terminated, truncated
