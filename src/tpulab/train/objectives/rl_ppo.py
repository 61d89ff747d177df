"""PPO on a functional environment (``objective.kind: ppo_env``), cleanrl's ``ppo.py`` recipe on
the one loop (issue 34).

The state carries everything a resume needs: actor-critic params, Adam state, the environments'
states and observations, the key, the optimizer-update count and the episode accumulators. The
DataSource has no iterator (``train=None``): the environments are the data. One loop step is one
jitted chunk of ``updates_per_step`` PPO updates, each a rollout of ``num_envs`` x ``num_steps``
(``tpulab.envs.rollout``: vmap + scan), GAE as a reverse scan, then ``epochs`` x ``minibatches``
optimizer steps through the one ``step.Update`` (global-norm clipping, Adam, the run's schedule).
Truncated transitions bootstrap from V(final_obs); terminated ones from nothing (``td_targets``).

``seeds`` > 1 trains that many seeds in one program: every leaf of the state but ``step`` gets
a leading lane axis (lane i starts from ``seed + i``) and the chunk is ``vmap``ped over it; each
lane's ``episode_return`` and ``loss`` are logged (``lane_metric``) and ``seed_scores`` scores each
lane's greedy policy on held-out episodes (``tpulab seeds``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.config import check, field
from tpulab.envs.base import make
from tpulab.envs.rollout import RolloutState, rollout
from tpulab.train import sharding
from tpulab.train.objective import DataSource, Objective, lane_metric
from tpulab.train.registry import register_objective
from tpulab.train.step import Update, compile_steps, optimizer


class PPOEnvState(NamedTuple):
    step: jax.Array  # loop steps (chunks) done
    params: Any  # actor-critic nnx.State
    opt_state: Any
    rng: jax.Array
    updates: jax.Array  # int32: optimizer steps taken (minibatch updates), the schedule's clock
    env_state: Any  # leaves [N, ...]
    obs: jax.Array  # [N, *obs_shape]
    ep_return: jax.Array  # [N] float32: the running episode's return so far
    episodes: jax.Array  # int32: episodes finished since step 0
    truncations: jax.Array  # int32: of which cut off by the time limit
    last_return: jax.Array  # float32: mean return of the episodes the latest chunk finished


# vmap axes of a state with a lane (seed) axis: the loop's step count is shared
LANES = PPOEnvState(None, *([0] * (len(PPOEnvState._fields) - 1)))
# the held-out episodes every seed is scored on: no training key is drawn from this one
HELD_OUT = 2**31 - 1


class _Inner(NamedTuple):
    """What ``Update`` steps: its ``step`` is the optimizer-update count, not the loop's."""

    step: jax.Array
    params: Any
    opt_state: Any


class ActorCritic(nnx.Module):
    """Separate actor and critic MLPs, tanh, orthogonal init (gain sqrt 2; actor head 0.01,
    critic head 1.0; zero biases), as cleanrl's CartPole agent."""

    def __init__(self, obs: int, actions: int, hidden: int, *, rngs: nnx.Rngs):
        def dense(i, o, gain):
            init = nnx.initializers.orthogonal(gain)
            return nnx.Linear(i, o, kernel_init=init, bias_init=nnx.initializers.zeros, rngs=rngs)

        g = math.sqrt(2.0)
        self.a1, self.a2 = dense(obs, hidden, g), dense(hidden, hidden, g)
        self.a3 = dense(hidden, actions, 0.01)
        self.c1, self.c2 = dense(obs, hidden, g), dense(hidden, hidden, g)
        self.c3 = dense(hidden, 1, 1.0)

    def __call__(self, obs):
        h = jnp.tanh(self.a2(jnp.tanh(self.a1(obs))))
        v = jnp.tanh(self.c2(jnp.tanh(self.c1(obs))))
        return self.a3(h), self.c3(v)[..., 0]


def td_targets(reward, final_value, terminated, gamma: float):
    """One-step targets: r + gamma V(final_obs), with nothing past a termination. A truncated
    transition bootstraps (its final_obs is a live state the time limit cut off)."""
    return reward + gamma * final_value * (1.0 - terminated.astype(jnp.float32))


def gae(reward, value, final_value, terminated, truncated, gamma: float, lam: float):
    """GAE over [T, N] as a reverse scan; the trace stops at every episode end (terminated or
    truncated), and only a termination stops the bootstrap. Returns (advantages, returns)."""
    delta = td_targets(reward, final_value, terminated, gamma) - value
    cont = 1.0 - (terminated | truncated).astype(jnp.float32)

    def back(next_adv, x):
        d, c = x
        adv = d + gamma * lam * c * next_adv
        return adv, adv

    _, adv = jax.lax.scan(back, jnp.zeros_like(value[0]), (delta, cont), reverse=True)
    return adv, adv + value


@register_objective
class PPOEnv(Objective):
    kind = "ppo_env"

    @dataclasses.dataclass(frozen=True)
    class Config:
        """cleanrl's CartPole defaults (ppo.py), but num_steps and num_envs set by the config."""

        env: str = field("cartpole", "environment name (tpulab.envs registry)")
        num_envs: int = field(4, "environments stepped in parallel")
        num_steps: int = field(128, "steps of each environment per rollout")
        updates_per_step: int = field(1, "PPO updates (rollout + epochs) in one loop step")
        epochs: int = field(4, "passes over each rollout")
        minibatches: int = field(4, "minibatches per pass; must divide num_envs * num_steps")
        hidden: int = field(64, "hidden units of each actor and critic layer")
        gamma: float = field(0.99, "discount")
        gae_lambda: float = field(0.95, "GAE lambda")
        clip_coef: float = field(0.2, "surrogate (and value) clip range")
        vf_coef: float = field(0.5, "value-loss coefficient")
        ent_coef: float = field(0.01, "entropy bonus coefficient")
        clip_vloss: bool = field(True, "clip the value loss as cleanrl does")
        norm_adv: bool = field(True, "normalise advantages per minibatch")
        seeds: int = field(1, "seeds trained together (vmapped): lane i starts from seed + i")
        eval_episodes: int = field(32, "held-out episodes each seed's greedy policy is scored on")

        def __post_init__(self):
            make(self.env)  # an unknown name: one line listing the registered ones
            names = ("num_envs", "num_steps", "updates_per_step", "epochs", "minibatches")
            for name in (*names, "seeds", "eval_episodes"):
                v = getattr(self, name)
                check(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                    f"objective.ppo_env.{name}={v!r} must be a positive integer",
                )
            check(
                1 <= self.hidden <= 4096, f"objective.ppo_env.hidden={self.hidden} not in [1, 4096]"
            )
            batch = self.num_envs * self.num_steps
            check(
                batch % self.minibatches == 0,
                f"objective.ppo_env.minibatches={self.minibatches} does not divide the batch "
                f"num_envs * num_steps = {batch}",
            )
            # non-finite floats are refused by the config layer before this runs
            check(0 < self.gamma <= 1, f"objective.ppo_env.gamma={self.gamma} not in (0, 1]")
            check(
                0 <= self.gae_lambda <= 1,
                f"objective.ppo_env.gae_lambda={self.gae_lambda} not in [0, 1]",
            )
            check(self.clip_coef > 0, f"objective.ppo_env.clip_coef={self.clip_coef} must be > 0")
            for name in ("vf_coef", "ent_coef"):
                check(getattr(self, name) >= 0, f"objective.ppo_env.{name} must be >= 0")

    # the lr schedule is sized by the run's length (cleanrl anneals to 0 over the run): a resume
    # that changes it would change the past schedule
    fixed_on_resume = ("train.steps",)
    seeds_option = "seeds"
    seed_curves = ("episode_return", "loss")
    seed_x = "env_steps"

    @classmethod
    def check_run(cls, config) -> None:
        o = config.objective.options
        per = f"{config.train.steps} x {o.updates_per_step} x {o.epochs} x {o.minibatches}"
        total = config.train.steps * o.updates_per_step * o.epochs * o.minibatches
        check(
            config.optim.schedule_steps == total,
            f"optim.schedule_steps={config.optim.schedule_steps} must be the run's optimizer "
            f"steps, train.steps x updates_per_step x epochs x minibatches = {per} = {total}, so "
            f"the lr anneals over the run (set optim.schedule_steps={total})",
        )

    @classmethod
    def lane_seeds(cls, config) -> list[int]:
        """The seed each lane starts from: ``seed``, ``seed + 1``, ..."""
        return [config.seed + i for i in range(config.objective.options.seeds)]

    @classmethod
    def _lanes(cls, config, fn, axes=LANES):
        """``fn(seed)`` on the one seed, or vmapped over the lanes' seeds."""
        seeds = cls.lane_seeds(config)
        if len(seeds) == 1:
            return lambda *a: fn(*a, seeds[0])
        lanes = jnp.asarray(seeds, jnp.int32)
        return lambda *a: jax.vmap(fn, out_axes=axes)(*a, lanes)

    @staticmethod
    def surrogate(adv, ratio, clip: float):
        """The policy loss: PPO's clipped surrogate, negated (minimised). A variant of PPO is a
        subclass that overrides this one function and keeps everything else."""
        return jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip, 1 + clip)).mean()

    # --- the graph and the state ----------------------------------------------------------------

    @classmethod
    def _env(cls, config):
        env = make(config.objective.options.env)
        return env, env.default_params()

    @classmethod
    def _graph(cls, config):
        o = config.objective.options
        env, _ = cls._env(config)
        obs = int(np.prod(env.obs_shape))

        def build(seed):
            rngs = nnx.Rngs(jax.random.key(seed))  # what nnx.Rngs(int) makes; a traced seed too
            return ActorCritic(obs, env.num_actions, o.hidden, rngs=rngs)

        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(config.seed)))
        return graphdef, cls._lanes(config, lambda seed: nnx.split(build(seed))[1], axes=0)

    @classmethod
    def _start(cls, config, tx):
        o = config.objective.options
        env, env_params = cls._env(config)

        def start(params, seed) -> PPOEnvState:
            key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
            key, env_key = jax.random.split(key)
            keys = jax.random.split(env_key, o.num_envs)
            obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(keys, env_params)
            return PPOEnvState(
                step=jnp.zeros((), jnp.int32),
                params=params,
                opt_state=tx.init(params),
                rng=key,
                updates=jnp.zeros((), jnp.int32),
                env_state=env_state,
                obs=obs,
                ep_return=jnp.zeros((o.num_envs,), jnp.float32),
                episodes=jnp.zeros((), jnp.int32),
                truncations=jnp.zeros((), jnp.int32),
                last_return=jnp.zeros((), jnp.float32),
            )

        return cls._lanes(config, start)

    @classmethod
    def abstract_state(cls, config, mesh):
        _, init_params = cls._graph(config)
        start = cls._start(config, optimizer(config.optim))
        shapes = jax.eval_shape(lambda: start(init_params()))
        return sharding.placed_shapes(shapes, mesh)

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        graphdef, _ = cls._graph(config)
        return nnx.merge(graphdef, params)  # obs -> (logits, value)

    # --- the data: none to iterate; a fixed set of start observations to evaluate on ------------

    def data(self) -> DataSource:
        env, env_params = self._env(self.config)
        keys = jax.random.split(jax.random.PRNGKey(12345), 16)
        obs, _ = jax.vmap(env.reset, in_axes=(0, None))(keys, env_params)
        o = self.options
        return DataSource(
            train=None,
            eval_batches=[{"obs": np.asarray(obs, np.float32)}],
            identity=hashlib.sha256(f"env {o.env} {env_params}".encode()).hexdigest(),
            description={"environment": o.env, "params": str(env_params), "evaluated_on": 16},
            eval_row_ids=lambda b: [str(i) for i in range(len(b["obs"]))],
        )

    # --- the steps ------------------------------------------------------------------------------

    def steps(self, mesh):
        config, o = self.config, self.options
        env, env_params = self._env(config)
        graphdef, init_params = self._graph(config)
        batch = o.num_envs * o.num_steps
        mb = batch // o.minibatches

        def policy(params, key, obs):
            logits, _ = nnx.merge(graphdef, params)(obs)
            return jax.random.categorical(key, logits)

        def loss(params, mb_data):
            logits, value = nnx.merge(graphdef, params)(mb_data["obs"])
            logp_all = jax.nn.log_softmax(logits)
            logp = jnp.take_along_axis(logp_all, mb_data["action"][:, None], axis=-1)[:, 0]
            logratio = logp - mb_data["logp"]
            ratio = jnp.exp(logratio)
            adv = mb_data["adv"]
            if o.norm_adv:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg = self.surrogate(adv, ratio, o.clip_coef)
            ret, old_v = mb_data["ret"], mb_data["value"]
            if o.clip_vloss:
                clipped = old_v + jnp.clip(value - old_v, -o.clip_coef, o.clip_coef)
                v_loss = 0.5 * jnp.maximum((value - ret) ** 2, (clipped - ret) ** 2).mean()
            else:
                v_loss = 0.5 * ((value - ret) ** 2).mean()
            entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
            total = pg - o.ent_coef * entropy + o.vf_coef * v_loss
            return total, {
                "policy_loss": pg,
                "value_loss": v_loss,
                "entropy": entropy,
                "approx_kl": ((ratio - 1) - logratio).mean(),
                "clip_frac": (jnp.abs(ratio - 1) > o.clip_coef).mean(),
            }

        update = Update.of(loss, config.optim)
        start = self._start(config, update.tx)

        def one_update(state: PPOEnvState, _):
            rng, roll_key, perm_key = jax.random.split(state.rng, 3)
            carry = RolloutState(state.env_state, state.obs, roll_key)
            carry, tr = rollout(env, policy, o.num_steps, state.params, carry, env_params)
            model = nnx.merge(graphdef, state.params)
            logits, value = model(tr.obs)
            _, final_value = model(tr.final_obs)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tr.action[..., None], axis=-1)[
                ..., 0
            ]
            adv, ret = gae(
                tr.reward, value, final_value, tr.terminated, tr.truncated, o.gamma, o.gae_lambda
            )
            # episode accounting: returns of the episodes this rollout finished
            done = tr.terminated | tr.truncated

            def account(run, x):
                r, d = x
                run = run + r
                return jnp.where(d, 0.0, run), jnp.where(d, run, 0.0)

            ep_return, finished = jax.lax.scan(account, state.ep_return, (tr.reward, done))
            n_done = done.sum()
            flat = {
                "obs": tr.obs.reshape(batch, -1),
                "action": tr.action.reshape(batch),
                "logp": logp.reshape(batch),
                "adv": adv.reshape(batch),
                "ret": ret.reshape(batch),
                "value": value.reshape(batch),
            }

            def epoch(inner, key):
                perm = jax.random.permutation(key, batch).reshape(o.minibatches, mb)
                return jax.lax.scan(
                    lambda s, idx: update(s, jax.tree.map(lambda x: x[idx], flat)), inner, perm
                )

            inner = _Inner(state.updates, state.params, state.opt_state)
            inner, metrics = jax.lax.scan(epoch, inner, jax.random.split(perm_key, o.epochs))
            metrics = jax.tree.map(jnp.mean, metrics)
            last = jnp.where(n_done > 0, finished.sum() / jnp.maximum(n_done, 1), state.last_return)
            metrics["episodes_finished"] = n_done.astype(jnp.int32)
            metrics["truncated"] = tr.truncated.sum().astype(jnp.int32)
            new = state._replace(
                params=inner.params,
                opt_state=inner.opt_state,
                rng=rng,
                updates=inner.step,
                env_state=carry.env_state,
                obs=carry.obs,
                ep_return=ep_return,
                episodes=state.episodes + n_done.astype(jnp.int32),
                truncations=state.truncations + metrics["truncated"],
                last_return=last,
            )
            return new, metrics

        counts = ("episodes_finished", "truncated")

        def chunk(state: PPOEnvState):  # one lane's K updates, summed up
            state, metrics = jax.lax.scan(one_update, state, None, length=o.updates_per_step)
            out = {k: (v.sum() if k in counts else v.mean()) for k, v in metrics.items()}
            out["lr"] = metrics["lr"][-1]
            out["episode_return"] = state.last_return
            return state, out

        def train_step(state: PPOEnvState, frozen, _batch):
            if o.seeds == 1:
                state, out = chunk(state)
            else:  # every lane, then their sums (counts) and means, and each lane's curves
                state, lanes = jax.vmap(chunk, in_axes=(LANES,), out_axes=(LANES, 0))(state)
                out = {k: (v.sum() if k in counts else v.mean()) for k, v in lanes.items()}
                for name in self.seed_curves:
                    out.update({lane_metric(name, i): lanes[name][i] for i in range(o.seeds)})
            out["env_steps"] = (state.step + 1) * o.updates_per_step * batch  # per seed
            return state._replace(step=state.step + 1), out

        def evaluate_lane(params, b):
            logits, value = nnx.merge(graphdef, params)(b["obs"])
            logp = jax.nn.log_softmax(logits)
            ent = -(jnp.exp(logp) * logp).sum(-1)
            n = jnp.float32(b["obs"].shape[0])
            return {"val_value": (value.sum(), n), "val_entropy": (ent.sum(), n)}

        def evaluate(params, frozen, b):
            if o.seeds == 1:
                return evaluate_lane(params, b)
            lanes = jax.vmap(evaluate_lane, in_axes=(0, None))(params, b)
            return jax.tree.map(jnp.sum, lanes)

        return compile_steps(
            mesh=mesh,
            graphdef=graphdef,
            tx=update.tx,
            start=start,
            train_step=train_step,
            evaluate=evaluate,
            merge=lambda params, frozen: nnx.merge(graphdef, params),
            init_params=init_params,
        )

    @classmethod
    def seed_scores(cls, config, state) -> list[float]:
        """Each lane's greedy policy (argmax) on ``eval_episodes`` held-out episodes (the same for
        every seed and every config: keys from ``HELD_OUT``, never a training key): the mean
        return, each episode run to its end (``max_steps`` at most)."""
        o = config.objective.options
        env, env_params = cls._env(config)
        graphdef, _ = cls._graph(config)
        reset_key, step_key = jax.random.split(jax.random.PRNGKey(HELD_OUT))
        resets = jax.random.split(reset_key, o.eval_episodes)
        steps = jax.random.split(step_key, env_params.max_steps)
        step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

        def score(params, _seed=None):
            model = nnx.merge(graphdef, params)
            obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(resets, env_params)

            def one(carry, key):
                obs, env_state, ret, alive = carry
                action = jnp.argmax(model(obs)[0], axis=-1)
                keys = jax.random.split(key, o.eval_episodes)
                obs, env_state, r, term, trunc, _ = step_envs(keys, env_state, action, env_params)
                return (obs, env_state, ret + r * alive, alive & ~(term | trunc)), None

            ret = jnp.zeros((o.eval_episodes,), jnp.float32)
            alive = jnp.ones((o.eval_episodes,), bool)
            (_, _, ret, _), _ = jax.lax.scan(one, (obs, env_state, ret, alive), steps)
            return ret.mean()

        scores = jax.jit(cls._lanes(config, score, axes=0))(state.params)
        return [float(x) for x in np.atleast_1d(np.asarray(scores))]

    def run_facts(self, steps, state) -> dict:
        o = self.options
        env, _ = self._env(self.config)
        per = o.seeds * o.updates_per_step * o.num_envs * o.num_steps
        return {
            "param_count": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "shapes": {
                "num_envs": o.num_envs,
                "num_steps": o.num_steps,
                "updates_per_step": o.updates_per_step,
                "obs": int(np.prod(env.obs_shape)),
                "actions": env.num_actions,
                "hidden": o.hidden,
                "seeds": o.seeds,
            },
            "work": {"unit": "env steps", "per_step": per},
        }
