"""Functional environments: CartPole against gymnasium's CartPole-v1, the gridworld's exact
termination/truncation counts, the registry, and rollouts traced once per shape."""

from __future__ import annotations

import sys

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpulab.envs as envs
from tpulab.compile_cache import count_compiles
from tpulab.envs import base, init_rollout, make, registered, rollout
from tpulab.errors import ConfigError

PARITY_ENVS, PARITY_STEPS, PARITY_LIMIT = 10, 150, 150
TOL = 1e-4


def _balance(policy_params, key, obs_n4):
    """A noisy balancing policy for the first 8 environments (they live to the time limit), always
    pushing right for the last 2 (they fall over and auto-reset again and again)."""
    lean_n = obs_n4[:, 2] + 0.5 * obs_n4[:, 3] + 0.05 * obs_n4[:, 0] + 0.1 * obs_n4[:, 1]
    greedy_n = (lean_n > 0).astype(jnp.int32)
    random_n = jax.random.randint(key, greedy_n.shape, 0, 2)
    explore_n = jax.random.uniform(jax.random.fold_in(key, 1), greedy_n.shape) < 0.2
    action_n = jnp.where(explore_n, random_n, greedy_n)
    return jnp.where(jnp.arange(obs_n4.shape[0]) >= 8, 1, action_n)


def _jax_trajectories(params):
    env = make("cartpole")
    carry = init_rollout(env, jax.random.key(0), PARITY_ENVS, params)
    _, tr = rollout(env, _balance, PARITY_STEPS, None, carry, params)
    return jax.tree.map(np.asarray, tr)


def _gymnasium_mismatch(tr) -> dict:
    """Step gymnasium's CartPole-v1 from the states the JAX run was in (injected before every
    step) with the JAX run's actions; the largest deviation of each output, and the counts."""
    worst = {"obs": 0.0, "reward": 0.0, "terminated": 0, "truncated": 0}
    counts = {"episodes": 0, "terminated": 0, "truncated": 0}
    for i in range(PARITY_ENVS):
        gym = gymnasium.make("CartPole-v1", max_episode_steps=PARITY_LIMIT)
        gym.reset(seed=i)
        for t in range(PARITY_STEPS):
            # The JAX state is exactly its observation (float32); gymnasium computes in float64.
            gym.unwrapped.state = tr.obs[t, i].astype(np.float64)
            obs, reward, term, trunc, _ = gym.step(int(tr.action[t, i]))
            # tpulab's truncated excludes a terminating step; gymnasium's TimeLimit sets both.
            trunc = trunc and not term
            worst["obs"] = max(worst["obs"], float(np.abs(obs - tr.final_obs[t, i]).max()))
            worst["reward"] = max(worst["reward"], abs(reward - float(tr.reward[t, i])))
            worst["terminated"] += int(term != bool(tr.terminated[t, i]))
            worst["truncated"] += int(trunc != bool(tr.truncated[t, i]))
            counts["terminated"] += int(term)
            counts["truncated"] += int(trunc)
            if term or trunc:
                counts["episodes"] += 1
                gym.reset()  # the JAX side auto-reset; the next injection sets the new state
        gym.close()
    return {"worst": worst, "counts": counts}


def _agrees(worst: dict) -> bool:
    return (
        worst["obs"] < TOL
        and worst["reward"] < TOL
        and worst["terminated"] == 0
        and worst["truncated"] == 0
    )


def test_cartpole_matches_gymnasium_cartpole_v1():
    params = make("cartpole").default_params()._replace(max_steps=PARITY_LIMIT)
    result = _gymnasium_mismatch(_jax_trajectories(params))
    worst, counts = result["worst"], result["counts"]
    assert _agrees(worst), worst
    # Both kinds of episode end were compared: 8 balanced episodes hit the limit at step 150.
    assert counts["truncated"] == 8 and counts["terminated"] >= 10, counts
    assert counts["episodes"] >= 10, counts


@pytest.mark.parametrize("change", [{"gravity": 10.0}, {"masspole": 0.11}])
def test_cartpole_parity_fails_with_a_perturbed_physics_constant(change):
    """Control: the comparison above can fail. Stepped with a changed constant, the JAX
    trajectories leave gymnasium's by several times the tolerance (measured: gravity 10.0, 1.3e-3;
    masspole 0.11, 8.8e-4; the unchanged constants: the parity test's worst)."""
    params = make("cartpole").default_params()._replace(max_steps=PARITY_LIMIT, **change)
    worst = _gymnasium_mismatch(_jax_trajectories(params))["worst"]
    assert not _agrees(worst) and worst["obs"] > 5 * TOL, worst


def _push_right(policy_params, key, obs_n4):
    return jnp.ones(obs_n4.shape[:1], jnp.int32)


def test_auto_reset_keeps_the_final_observation():
    env = make("cartpole")
    params = env.default_params()
    carry = init_rollout(env, jax.random.key(1), 2, params)
    _, tr = rollout(env, _push_right, 60, None, carry, params)
    t, i = np.argwhere(np.asarray(tr.terminated))[0]
    # The final observation is past a threshold; the next one is a fresh episode's.
    final = np.asarray(tr.final_obs[t, i])
    assert abs(final[0]) > params.x_threshold or abs(final[2]) > params.theta_threshold
    assert np.abs(np.asarray(tr.obs[t + 1, i])).max() <= 0.05
    # Off the episode ends the final observation is the next observation.
    live = ~np.asarray(tr.terminated[:-1] | tr.truncated[:-1])
    assert np.array_equal(np.asarray(tr.final_obs[:-1])[live], np.asarray(tr.obs[1:])[live])


# Gridworld policies, by environment index: 0 walks right along the top row and then down the
# last column (the shortest path, 8 steps on 5x5); 1 pushes up into the wall forever.
def _scripted(policy_params, key, obs_nc):
    cell_n = jnp.argmax(obs_nc, axis=-1)
    size = int(round(obs_nc.shape[-1] ** 0.5))
    shortest_n = jnp.where(cell_n % size < size - 1, 1, 2)  # right, else down
    return jnp.where(jnp.arange(obs_nc.shape[0]) == 0, shortest_n, 0)


@pytest.mark.parametrize(
    "max_steps, terminated, truncated",
    [
        # The limit is the shortest path: reaching the goal on the last step is a termination.
        (8, [5, 0], [0, 5]),
        # One step short: the same walk is cut off every time, and never reaches the goal.
        (7, [0, 0], [5, 5]),
        (20, [5, 0], [0, 2]),
    ],
)
def test_gridworld_counts_terminations_and_truncations_exactly(max_steps, terminated, truncated):
    env = make("gridworld", size=5)
    params = env.default_params()._replace(max_steps=max_steps)
    carry = init_rollout(env, jax.random.key(0), 2, params)
    _, tr = rollout(env, _scripted, 40, None, carry, params)
    assert np.asarray(tr.terminated).sum(0).tolist() == terminated
    assert np.asarray(tr.truncated).sum(0).tolist() == truncated
    assert not np.any(np.asarray(tr.terminated & tr.truncated))
    # The reward is the goal's, paid exactly on the terminations.
    assert np.asarray(tr.reward).sum(0).tolist() == [float(n) for n in terminated]


def test_registry_names_and_unknown_name_is_one_line():
    assert {"cartpole", "gridworld"} <= set(registered())
    with pytest.raises(ConfigError) as err:
        make("cartpol")
    message = str(err.value)
    assert "\n" not in message and "'cartpol'" in message
    assert "cartpole" in message and "gridworld" in message
    with pytest.raises(ConfigError, match="no option colour; it takes: size"):
        make("gridworld", colour=3)
    with pytest.raises(ConfigError, match="size must be an integer >= 2"):
        make("gridworld", size=1)


def test_a_new_environment_is_one_new_file(tmp_path, monkeypatch):
    """A module dropped into the package with its ``@register`` line is found by ``make``; no
    other file names it."""
    (tmp_path / "toy.py").write_text(
        "import dataclasses\n"
        "from tpulab.envs.cartpole import CartPole\n"
        "from tpulab.envs.base import register\n"
        "@register('toy')\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Toy(CartPole):\n"
        "    pass\n"
    )
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(envs, "__path__", [*envs.__path__, str(tmp_path)])
    assert "toy" not in base._REGISTRY
    try:
        assert type(make("toy")).__name__ == "Toy"
    finally:
        sys.modules.pop("tpulab.envs.toy", None)


def test_rollout_is_traced_once_per_shape():
    env = make("cartpole")
    params = env.default_params()
    traces = []

    def policy(policy_params, key, obs_n4):
        traces.append(obs_n4.shape)  # runs only while JAX traces, never per step
        return jax.random.randint(key, obs_n4.shape[:1], 0, 2)

    carry = init_rollout(env, jax.random.key(0), 3, params)
    carry, _ = rollout(env, policy, 16, None, carry, params)
    assert len(traces) == 1
    with count_compiles() as compiles:
        carry, _ = rollout(env, policy, 16, None, carry, params)
    assert len(traces) == 1 and compiles["n"] == 0  # same shapes: no retrace, no compile
    wider = init_rollout(env, jax.random.key(1), 5, params)
    for _ in range(2):
        wider, _ = rollout(env, policy, 16, None, wider, params)
    assert traces == [(3, 4), (5, 4)]  # a new number of environments: exactly one more trace
    heavier = params._replace(masspole=0.2)  # params are compile-time constants: one more trace
    for _ in range(2):
        rollout(env, policy, 16, None, carry, heavier)
    assert len(traces) == 3
    # Control: the counter does count. A new function object per call is a new static argument.
    for _ in range(2):
        rollout(env, lambda *a: policy(*a), 16, None, carry, params)
    assert len(traces) == 5


def test_rollout_equals_stepping_each_environment_in_python():
    env = make("gridworld", size=3)
    params = env.default_params()._replace(max_steps=5)

    def policy(policy_params, key, obs_nc):
        return jax.random.randint(key, obs_nc.shape[:1], 0, 4)

    carry = init_rollout(env, jax.random.key(2), 2, params)
    _, tr = rollout(env, policy, 12, None, carry, params)
    key, states, obs = carry.key, carry.env_state, carry.obs
    for t in range(12):
        key, key_act, key_step = jax.random.split(key, 3)
        action = policy(None, key_act, obs)
        keys = jax.random.split(key_step, 2)
        stepped = [
            env.step(keys[i], jax.tree.map(lambda x, i=i: x[i], states), action[i], params)
            for i in range(2)
        ]
        assert np.array_equal(np.asarray(tr.action[t]), np.asarray(action))
        assert [bool(s[3]) for s in stepped] == np.asarray(tr.terminated[t]).tolist()
        assert [bool(s[4]) for s in stepped] == np.asarray(tr.truncated[t]).tolist()
        obs = jnp.stack([s[0] for s in stepped])
        states = jax.tree.map(lambda *xs: jnp.stack(xs), *[s[1] for s in stepped])
        assert np.array_equal(
            np.asarray(tr.final_obs[t]), np.stack([s[5]["final_obs"] for s in stepped])
        )


@pytest.mark.parametrize("num_envs, num_steps", [(0, 4), (2, 0), (2.5, 4), (2, True)])
def test_non_positive_or_non_integer_counts_are_refused(num_envs, num_steps):
    env = make("gridworld")
    params = env.default_params()
    with pytest.raises(ConfigError, match="must be a positive integer"):
        carry = init_rollout(env, jax.random.key(0), num_envs, params)
        rollout(env, _scripted, num_steps, None, carry, params)


def test_the_throughput_benchmark_times_the_rollout():
    """benchmarks/env_throughput.py's timing at a tiny size (the script is run by hand)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "env_throughput", REPO / "benchmarks" / "env_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench._measure({"tpulab.envs": bench._tpulab_case(4, 8)}, 4, 8, 20)
    assert row["impl"] == "tpulab.envs" and len(row["times_s"]) == 20
    assert row["steps_per_s_median"] == 4 * 8 / row["median_s"] > 0
