"""PPO-RLHF on the one loop: each loop step is one PPO minibatch update.

A round is ``epochs x minibatches`` loop steps. Its first step (``position`` 0, under ``lax.cond``
so the step stays one jitted program) samples ``rollouts`` replies to the round's prompts through
the compiled generation loop with the service's own sampler (``ModelFns.generate``, fp32 cache),
scores them with the frozen reward model at the last reply byte (float32), computes the old
log-probs and values with the behaviour policy, the frozen reference's log-probs, the per-token
KL penalty, GAE and whitened advantages; then every step of the round takes one clipped-PPO update
on a minibatch of them (``ppo_losses``). The round (rollouts, masks, old log-probs, values,
rewards, advantages, returns, the sampler and minibatch keys, the position) is part of the
checkpointed state (``ppo_state.PPOState``), so a kill in the middle of a round resumes bitwise.

The old log-probs are the trainer's own, computed by the function the loss calls, on the
minibatches of the round's first epoch in the order that epoch takes them: on the first update of
a round the policy is still the behaviour policy, so every importance ratio is exactly 1.0. The
sampler's own log-probs of the tokens it drew are kept beside them (``sampler_logp``): the
largest gap between the two (``sampler_gap``, the cached decode path against the full forward)
says the trainer scores the distribution the replies were drawn from (same temperature, no
top-k). Dropout is off in every forward (a ratio under dropout would not be 1 at the start).

Prompts are the SFT prompts, cut to leave ``max_new`` reply bytes in ``data.seq_len``, each
batch repeated for the steps of its round (``ppo_prompts``).

Frozen, passed to every step (``Steps.frozen``), digest-checked at the end of the run, both read
by ``frozen``: the reference (``objective.reference``, default: the init checkpoint, read as a
separate copy) and the reward model (``objective.reward_model``). Identities (every checkpoint,
refused on resume when changed): init, reference, reward model and dataset; the behaviour policy's
sha256 (taken on the host at each round start, ``Train``) is in the round state and in every step's
record (``behaviour_sha256``).

Metrics: per step, the update's (loss, pg_loss, vf_loss, entropy, clip_frac, approx_kl,
log_ratio_max, ...) and its round's (score: the proxy reward, kl, response_length, stop_rate,
sampler_gap); per evaluation, replies to held-out prompts with one fixed key: val_reward (proxy),
val_gold_reward (r*, ``tpulab.data.preference.gold_reward``, on the host), val_kl and
val_response_length, the over-optimisation curve (Gao et al., arXiv:2210.10760). No host callback
runs inside a jitted program: they would keep it out of the persistent compilation cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.data import dialogue
from tpulab.data.contract import load_checked
from tpulab.data.preference import gold_reward
from tpulab.data.tokenizer import PAD
from tpulab.model.decode import ModelFns
from tpulab.model.sampling import token_logprobs
from tpulab.train.config import RunConfig
from tpulab.train.objective import DataSource
from tpulab.train.objectives import ppo_losses as L
from tpulab.train.objectives.frozen import load_language_model, load_reward_model
from tpulab.train.objectives.lm import LanguageModel
from tpulab.train.objectives.ppo_config import PPOConfig, check_ppo_run
from tpulab.train.objectives.ppo_prompts import (
    build_prompts,
    check_prompt_batch,
    eval_prompt_batches,
    prompt_dataset,
)
from tpulab.train.objectives.ppo_state import (
    PPOState,
    RoundState,
    Sizes,
    abstract_state,
    body_graph,
    policy_module,
    start_state,
    value_graph,
)
from tpulab.train.registry import register_objective
from tpulab.train.step import Steps, Update, compile_steps, digest_words, tree_digest

ROLLOUT_CACHE = "fp32"  # the sampler's cache precision: the nearest to the trainer's fp32 forward


# --- the steps -----------------------------------------------------------------------------------


def _gold_host(tokens, lengths, n) -> np.ndarray:
    """r* of each reply, on the host (``preference.gold_reward``): prompt = the bytes between SOH
    and STX, reply = the sampled tokens (a BOS or PAD token, which is no byte, counts as 0x00: not
    text)."""
    out = np.zeros(len(tokens), np.float32)
    for i, (row, start, k) in enumerate(
        zip(np.asarray(tokens), np.asarray(lengths), np.asarray(n))
    ):
        if k > 0:
            prompt = bytes(int(x) for x in row[2 : start - 1])
            reply = bytes(int(x) if x < 256 else 0 for x in row[start : start + k])
            out[i] = gold_reward(prompt, reply)
    return out


class Fns:
    """PPO's pure functions for one run config (shapes static); ``steps`` jits them."""

    def __init__(self, config: RunConfig):
        self.config, self.ppo, self.z = config, config.objective.ppo, Sizes.of(config)
        self.graphdef, self.abstract_params = value_graph(config)
        self.body_def = body_graph(config)
        self.gen = ModelFns(nnx.merge(self.body_def, self.abstract_params["body"]))
        self.update = Update.of(self.loss, config.optim)
        self.eval_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 2)

    # forward passes (dropout off) ----------------------------------------------------------

    def forward(self, params, tokens):
        """The policy's log-probs of each next token (at the sampling temperature), its values
        and logits, for rows ``tokens`` [b, T + 1]: what the old log-probs and the loss share."""
        logits, values = nnx.merge(self.graphdef, params)(tokens[:, :-1])
        return token_logprobs(logits, tokens[:, 1:], self.ppo.temperature), values, logits

    def ref_logp(self, ref_params, tokens):
        logits = nnx.merge(self.body_def, ref_params)(tokens[:, :-1], deterministic=True)
        return token_logprobs(logits, tokens[:, 1:], self.ppo.temperature)

    def score(self, rm_params, tokens, read_b):
        """The reward model's float32 score at input position ``read_b`` (the last reply byte)."""
        return nnx.merge(self.graphdef, rm_params).scores_at(tokens[:, :-1], read_b)

    def rollout(self, body_params, prompts, lengths, keys, temperature, max_new_b):
        """Replies through the compiled loop -> tokens [b, T + 1], mask [b, T], the sampler's
        log-probs [b, T] and the reply lengths [b]."""
        t1 = self.z.seq + 1
        b = prompts.shape[0]
        out, n, lp = self.gen.generate(
            ROLLOUT_CACHE,
            self.gen.flat(body_params),
            prompts,
            lengths,
            max_new_b,
            jnp.full((b,), temperature, jnp.float32),
            jnp.zeros((b,), jnp.int32),
            keys,
            jnp.int32(dialogue.STOP),
            logprobs=True,
        )
        s = out.shape[1]
        start, k = lengths[:, None], n[:, None]
        j = jnp.arange(t1)[None]
        head = jnp.pad(prompts, ((0, 0), (0, t1 - prompts.shape[1])), constant_values=PAD)
        new = jnp.take_along_axis(out, jnp.clip(j - start, 0, s - 1), axis=1)
        tokens = jnp.where(j < start, head, jnp.where(j < start + k, new, PAD))
        t = jnp.arange(self.z.seq)[None]
        mask = ((t + 1 >= start) & (t + 1 < start + k)).astype(jnp.float32)
        slp = jnp.take_along_axis(lp, jnp.clip(t + 1 - start, 0, s - 1), axis=1) * mask
        return tokens, mask, slp, n

    # a round's start ----------------------------------------------------------------------

    def start_round(self, params, rng, frozen, batch, index, behaviour, sample_temperature=None):
        """-> (rng, RoundState at position 0): rollouts, scores, old log-probs, values, rewards,
        advantages; ``behaviour`` is the sha256 (``digest_words``) of ``params["body"]``, taken on
        the host. ``sample_temperature`` (tests' negative control only) samples at another
        temperature than the trainer scores at."""
        z, p = self.z, self.ppo
        rng, sample_key, perm_key = jax.random.split(rng, 3)
        prompts = jnp.repeat(batch["inputs"], z.repeat, axis=0)
        lengths = jnp.repeat(batch["length"], z.repeat, axis=0)
        t_sample = p.temperature if sample_temperature is None else sample_temperature
        tokens, mask, slp, n = self.rollout(
            params["body"],
            prompts,
            lengths,
            jax.random.split(sample_key, z.rollouts),
            t_sample,
            jnp.full((z.rollouts,), z.max_new, jnp.int32),
        )
        read = lengths + n - 1  # the input position of the last reply byte
        order = self.minibatch_rows(perm_key, 0).reshape(z.minibatches, z.minibatch)

        def chunk(rows):  # epoch 0's minibatches, in its order: the loss sees the same rows
            toks = tokens[rows]
            logp, values, _ = self.forward(params, toks)
            ref = self.ref_logp(frozen["reference"], toks)
            return logp, values, ref, self.score(frozen["reward"], toks, read[rows])

        outs = jax.lax.map(chunk, order)
        rows = order.reshape(-1)
        logp, values, ref, score = (
            jnp.zeros_like(x.reshape(z.rollouts, *x.shape[2:]))
            .at[rows]
            .set(x.reshape(z.rollouts, *x.shape[2:]))
            for x in outs
        )
        logp, values, ref = logp * mask, values * mask, ref * mask
        kl = L.KL_ESTIMATORS[p.kl_estimator](logp, ref) * mask
        last = (jnp.arange(z.seq)[None] == (read - 1)[:, None]).astype(jnp.float32)
        rewards = (-p.kl_coef * kl + score[:, None] * last) * mask
        adv, returns = L.gae(rewards, values, mask, p.gamma, p.lam)
        return rng, RoundState(
            tokens=tokens,
            mask=mask,
            old_logp=logp,
            sampler_logp=slp,
            old_values=values,
            ref_logp=ref,
            rewards=rewards,
            advantages=L.whiten(adv, mask),
            returns=returns,
            score=score,
            length=n,
            sample_key=sample_key,
            perm_key=perm_key,
            position=jnp.zeros((), jnp.int32),
            index=jnp.asarray(index, jnp.int32),
            behaviour_sha256=jnp.asarray(behaviour, jnp.uint32),
        )

    def minibatch_rows(self, perm_key, epoch):
        return jax.random.permutation(jax.random.fold_in(perm_key, epoch), self.z.rollouts)

    def rows_at(self, rnd: RoundState):
        """The rows of the update at ``rnd.position``: minibatch m of epoch e's permutation."""
        z = self.z
        epoch, m = rnd.position // z.minibatches, rnd.position % z.minibatches
        order = self.minibatch_rows(rnd.perm_key, epoch)
        return jax.lax.dynamic_slice(order, (m * z.minibatch,), (z.minibatch,))

    # an update ----------------------------------------------------------------------------

    def loss(self, params, rnd: RoundState, rows):
        p = self.ppo
        mask = rnd.mask[rows]
        logp, values, logits = self.forward(params, rnd.tokens[rows])
        pg, stats = L.policy_loss(logp, rnd.old_logp[rows], rnd.advantages[rows], mask, p.clip)
        vf, vf_clip = L.value_loss(
            values, rnd.old_values[rows], rnd.returns[rows], mask, p.value_clip
        )
        ent = L.masked_mean(L.entropy(logits, p.temperature), mask)
        total = pg + p.vf_coef * vf - p.entropy_coef * ent
        return total, {
            "pg_loss": pg,
            "vf_loss": vf,
            "vf_clip_frac": vf_clip,
            "entropy": ent,
            **stats,
        }

    def round_stats(self, rnd: RoundState) -> dict:
        """The round's numbers, the same in each of its steps' records."""
        mask = rnd.mask
        kl = L.KL_ESTIMATORS[self.ppo.kl_estimator](rnd.old_logp, rnd.ref_logp) * mask
        stopped = jnp.any((rnd.tokens[:, 1:] == dialogue.STOP) & (mask > 0), axis=1)
        return {
            "score": jnp.mean(rnd.score),
            "kl": jnp.mean(jnp.sum(kl, axis=1)),
            "response_length": jnp.mean(rnd.length.astype(jnp.float32)),
            "stop_rate": jnp.mean(stopped.astype(jnp.float32)),
            "sampler_gap": jnp.max(jnp.abs(rnd.sampler_logp - rnd.old_logp) * mask),
            "round": rnd.index,
            "position": rnd.position,
            "behaviour_sha256": rnd.behaviour_sha256,
        }

    def train_step(self, state: PPOState, frozen, batch, behaviour):
        """One update; a round's first also samples and scores it (``behaviour``: the sha256 of
        the policy about to sample, ignored on the round's other steps)."""

        def begin(_):
            index = state.round.index + 1
            return self.start_round(state.params, state.rng, frozen, batch, index, behaviour)

        rng, rnd = jax.lax.cond(
            state.round.position == 0, begin, lambda _: (state.rng, state.round), None
        )
        state, metrics = self.update(state, rnd, self.rows_at(rnd))
        metrics = {**metrics, **self.round_stats(rnd)}  # the round at this update's position
        rnd = rnd._replace(position=(rnd.position + 1) % self.z.per_round)
        return state._replace(rng=rng, round=rnd), metrics

    # evaluation ---------------------------------------------------------------------------

    def evaluate(self, params, frozen, batch):
        """Replies to held-out prompts, sampled at the training temperature with one fixed key (the
        same draws at every evaluation): proxy reward, KL to the reference (the sequence log-ratio,
        k1), length, as sums with the live prompts as weights; and the replies, for the gold
        reward on the host (``Evaluate``)."""
        live, lengths = jnp.any(batch["mask"] > 0, axis=1).astype(jnp.float32), batch["length"]
        b = lengths.shape[0]
        tokens, mask, _, n = self.rollout(
            params["body"],
            batch["inputs"],
            lengths,
            jax.random.split(self.eval_key, b),
            self.ppo.temperature,
            jnp.where(live > 0, self.z.max_new, 0).astype(jnp.int32),
        )
        logp, _, _ = self.forward(params, tokens)
        ref = self.ref_logp(frozen["reference"], tokens)
        read = jnp.clip(lengths + n - 1, 0, self.z.seq - 1)
        score = self.score(frozen["reward"], tokens, read)
        kl = jnp.sum(L.kl_k1(logp, ref) * mask, axis=1)
        w = jnp.sum(live)
        sums = {
            "val_reward": (jnp.sum(score * live), w),
            "val_kl": (jnp.sum(kl * live), w),
            "val_response_length": (jnp.sum(n * live), w),
        }
        return sums, (tokens, lengths, n * live.astype(jnp.int32))

    # jitted, with shardings ----------------------------------------------------------------

    def steps(self, mesh, load_params, frozen) -> Steps:
        """``load_params()``: a fresh host copy of the starting parameters; ``frozen``: host
        arrays (the reference and the reward model)."""
        cfg = self.config
        return compile_steps(
            mesh=mesh,
            graphdef=self.graphdef,
            tx=self.update.tx,
            shapes=jax.eval_shape(lambda: start_state(cfg, self.abstract_params)),
            start=lambda params: start_state(cfg, params),
            train_step=self.train_step,
            evaluate=self.evaluate,
            merge=lambda params, frozen: policy_module(cfg, params),
            load_params=load_params,
            frozen=frozen,
            host_args=1,
            host_train=lambda fn: Train(fn, self.z.per_round),
            host_eval=Evaluate,
        )


class Train:
    """The jitted step with the behaviour digest it needs at a round start, taken on the host.

    A host callback inside the step would keep its executable out of JAX's persistent compilation
    cache (executables with host callbacks are never written there), so every resumed process
    would compile it cold; instead the sha256 of the policy about to sample is an argument. The
    step number is counted on the host (read from the state once, and again whenever the caller
    passes a state this object did not return), so a round start costs one read of the policy's
    weights and no other step waits on the device."""

    def __init__(self, fn, per_round: int):
        self.fn, self.per_round = fn, per_round
        self._next = None  # (the state.step array this returned, its host value)
        self._zeros = jnp.zeros((8,), jnp.uint32)

    def __call__(self, state, frozen, batch):
        known = self._next is not None and self._next[0] is state.step
        step = self._next[1] if known else int(state.step)
        behaviour = self._zeros
        if step % self.per_round == 0:
            behaviour = jnp.asarray(digest_words(tree_digest(state.params["body"])))
        out, metrics = self.fn(state, frozen, batch, behaviour)
        self._next = (out.step, step + 1)
        return out, metrics

    def lower(self, state, frozen, batch):
        return self.fn.lower(state, frozen, batch, self._zeros)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


class Evaluate:
    """The jitted evaluation, then the gold reward r* of its replies on the host (the loop reads
    the evaluation's numbers at once anyway)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, params, frozen, batch):
        sums, (tokens, lengths, n) = self.fn(params, frozen, batch)
        gold = _gold_host(*jax.device_get((tokens, lengths, n)))
        return {**sums, "val_gold_reward": (np.float32(gold.sum()), sums["val_reward"][1])}

    def lower(self, params, frozen, batch):
        return self.fn.lower(params, frozen, batch)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


# --- the objective -------------------------------------------------------------------------------


@register_objective
class PPO(LanguageModel):
    kind = "ppo"
    Config = PPOConfig
    uses = ("data", "reference", "init_fallback")
    needs = {
        "init": "the run dir of the checkpoint it starts from",
        "reward_model": "the run dir of the reward model",
    }
    refuses = {"lora": "ppo trains every parameter"}

    @classmethod
    def check_run(cls, config) -> None:
        super().check_run(config)
        check_ppo_run(config)

    @classmethod
    def abstract_state(cls, config, mesh):
        """The whole state: policy, value head, optimizer, the round in progress."""
        return abstract_state(config, mesh)

    @classmethod
    def model_from_params(cls, config, params, base_params=None):
        return policy_module(config, params)  # the policy alone

    @classmethod
    def plain_params(cls, restored):
        return restored.state.params["body"]

    def __init__(self, config):
        super().__init__(config)
        obj, data = config.objective, config.data
        self.init = load_language_model(config, "init")
        self.reference = load_language_model(config, "reference")
        self.reward = load_reward_model(config)
        if obj.data is None:
            source = dialogue.from_plays(load_checked(data), data)
        else:
            source = dialogue.from_jsonl(obj.data, data)
        self.prompts = build_prompts(source, data.seq_len, obj.ppo.max_new)
        self.fns = Fns(config)

    def identities(self) -> dict[str, str]:
        return {
            "init": self.init.digest,
            "reference": self.reference.digest,
            "reward_model": self.reward.digest,
            "dataset": self.prompts.identity,
        }

    def data(self) -> DataSource:
        cfg, rows = self.config, self.prompts.train
        per_round = cfg.objective.ppo.steps_per_round
        return DataSource(
            train=lambda index, count: iter(
                prompt_dataset(rows, cfg.data, per_round, index, count)
            ),
            eval_batches=eval_prompt_batches(
                self.prompts.eval, cfg.data.batch_size, cfg.train.eval_batches
            ),
            identity=self.prompts.identity,
            description={
                **self.prompts.describe(),
                "init": self.init.record,
                "reference": self.reference.record,
                "reward_model": self.reward.record,
            },
            check=check_prompt_batch,
        )

    def _start_params(self):
        """A fresh host copy of the starting parameters: the init model as the policy body, the
        value head at zero."""
        params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self.fns.abstract_params)
        params["body"] = load_language_model(self.config, "init").params
        return params

    def steps(self, mesh):
        frozen = {"reference": self.reference.params, "reward": self.reward.params}
        return self.fns.steps(mesh, self._start_params, frozen)

    def describe(self, steps, state) -> dict:
        z, p = self.fns.z, self.config.objective.ppo
        return {
            "ppo": {
                "rollouts_per_round": z.rollouts,
                "prompts_per_round": z.prompts,
                "steps_per_round": z.per_round,
                "minibatch_rows": z.minibatch,
                "kl_estimator": p.kl_estimator,
                "value_head": f"Dense({self.config.model.d_model}, 1) + bias on the policy trunk",
                "rollout_cache": ROLLOUT_CACHE,
            }
        }


__all__ = ["PPO", "Fns"]
