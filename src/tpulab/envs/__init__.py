"""Functional environments (gymnax's API shape) and batched, scanned rollouts. Depends only on JAX
and ``tpulab.errors``; the RL objective builds on it."""

from tpulab.envs.base import Environment, make, register, registered
from tpulab.envs.rollout import Policy, RolloutState, Transition, init_rollout, rollout

__all__ = [
    "Environment",
    "Policy",
    "RolloutState",
    "Transition",
    "init_rollout",
    "make",
    "register",
    "registered",
    "rollout",
]
