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

Prompts are the SFT prompts (``tpulab.data.dialogue``; ``objective.data`` selects a JSONL), cut
from the left to leave ``max_new`` reply bytes in ``data.seq_len``. The data source gives every
step a batch, each prompt batch repeated for the ``epochs x minibatches`` steps of its round: a
round's steps all see the prompts it sampled from (only its first reads them), no prompt is
skipped, and the data position stays exactly the loop step.

Frozen, passed to every step (``Steps.frozen``), digest-checked at the end of the run: the
reference (``objective.reference``, default: the init checkpoint, read as a separate copy) and the
reward model (``objective.reward_model``). Identities (every checkpoint, refused on resume when
changed): init, reference, reward model and dataset; the behaviour policy's sha256 (taken on the
host at each round start, ``Train``) is in the round state and in every step's record
(``behaviour_sha256``).

Metrics: per step, the update's (loss, pg_loss, vf_loss, entropy, clip_frac, approx_kl,
log_ratio_max, ...) and its round's (score: the proxy reward, kl, response_length, stop_rate,
sampler_gap); per evaluation, replies to held-out prompts with one fixed key: val_reward (proxy),
val_gold_reward (r*, ``tpulab.data.preference.gold_reward``, on the host), val_kl and
val_response_length, the over-optimisation curve (Gao et al., arXiv:2210.10760). No host callback
runs inside a jitted program: they would keep it out of the persistent compilation cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpulab.checkpoint.files import manifest_digest
from tpulab.checkpoint.store import read_meta, read_state
from tpulab.config import from_dict, to_dict
from tpulab.data import dialogue
from tpulab.data.config import DataConfig
from tpulab.data.contract import load_checked
from tpulab.data.pipeline import READ_OPTIONS, process_batches
from tpulab.data.preference import gold_reward
from tpulab.data.tokenizer import BOS, PAD
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import TpulabError
from tpulab.model.decode import ModelFns
from tpulab.model.sampling import token_logprobs
from tpulab.train import sharding
from tpulab.train.config import OptimConfig, RunConfig
from tpulab.train.objectives import ppo_losses as L
from tpulab.train.objectives.base import DataSource, Objective
from tpulab.train.objectives.ppo_state import (
    PPOState,
    RoundState,
    Sizes,
    body_graph,
    policy_module,
    start_state,
    value_graph,
)
from tpulab.train.objectives.sft import load_base
from tpulab.train.restore import checkpoint_dir
from tpulab.train.step import (
    Bound,
    Steps,
    TrainState,
    digest_words,
    lr_schedule,
    optimizer,
    tree_all_finite,
    tree_digest,
)

PROMPT_BUILDER = "tpulab-ppo-prompts-v1"
ROLLOUT_CACHE = "fp32"  # the sampler's cache precision: the nearest to the trainer's fp32 forward


# --- prompts -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Prompt rows [P, W + 1]: BOS SOH prompt STX, PAD to width W, then the length."""

    train: np.ndarray
    eval: np.ndarray
    params: dict
    identity: str

    def describe(self) -> dict:
        return {
            "builder": PROMPT_BUILDER,
            **self.params,
            "identity": self.identity,
            "train_prompts": len(self.train),
            "eval_prompts": len(self.eval),
        }


def prompt_rows(pairs, seq_len: int, max_new: int, cut: bool) -> np.ndarray:
    """Distinct prompts that leave ``max_new`` reply tokens in ``seq_len`` positions (built-in
    pairs are cut from the left, as ``dialogue.fit`` cuts them; a user's prompt is kept whole or
    left out)."""
    width = seq_len - max_new
    rows, seen = [], set()
    for pair in pairs:
        room = dialogue.Pair(pair.prompt, b"x" * (max_new - 1), pair.source)
        fitted = dialogue.fit(room, seq_len - 1) if cut else room
        if fitted is None or fitted.prompt in seen:
            continue
        ids = [BOS, dialogue.PROMPT_START, *fitted.prompt, dialogue.RESPONSE_START]
        if len(ids) > width:
            continue
        seen.add(fitted.prompt)
        row = np.full(width + 1, PAD, np.int32)
        row[: len(ids)], row[-1] = ids, len(ids)
        rows.append(row)
    return np.stack(rows) if rows else np.zeros((0, width + 1), np.int32)


def build_prompts(source: dialogue.Dialogue, seq_len: int, max_new: int) -> Prompts:
    cut = source.params.get("source") == "plays"
    train = prompt_rows(source.train, seq_len, max_new, cut)
    evals = prompt_rows(source.eval, seq_len, max_new, cut)
    params = {"dialogue_identity": source.identity, "seq_len": seq_len, "max_new": max_new}
    for part, rows in (("training", train), ("evaluation", evals)):
        if not len(rows):
            raise TpulabError(
                f"no {part} prompt leaves objective.ppo.max_new={max_new} reply bytes in "
                f"data.seq_len={seq_len}"
            )
    h = hashlib.sha256(json.dumps({"builder": PROMPT_BUILDER, **params}, sort_keys=True).encode())
    for rows in (train, evals):
        h.update(rows.tobytes())
    return Prompts(train, evals, params, h.hexdigest())


def prompt_batch(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Prompt rows -> ``inputs`` [B, W] (BOS SOH prompt STX, PAD after) and ``length`` [B]."""
    return {"inputs": rows[:, :-1], "length": rows[:, -1]}


def prompt_dataset(
    rows: np.ndarray, cfg: DataConfig, per_round: int, index: int = 0, count: int = 1
) -> grain.IterDataset:
    """Shuffled, repeated prompt batches, each given to the ``per_round`` steps of its round; each
    process its own rows of every batch (``tpulab.data.pipeline.process_batches``)."""
    batches = process_batches(rows, cfg, index, count)
    steps = grain.MapDataset.range(len(batches)).map(lambda i: batches[i // per_round])
    return steps.map(prompt_batch).to_iter_dataset(READ_OPTIONS)


def eval_prompt_batches(rows: np.ndarray, batch_size: int, max_batches: int) -> list[dict]:
    """The first ``max_batches`` batches of held-out prompts, with ``mask`` [B, W] 1 on each
    prompt's tokens; a short last batch is filled with idle rows (mask 0: nothing sampled, nothing
    counted)."""
    rows = rows[: batch_size * max_batches]
    live = np.ones(len(rows), np.float32)
    short = -len(rows) % batch_size
    if short:
        filler = np.full((short, rows.shape[1]), PAD, np.int32)
        filler[:, 0], filler[:, -1] = BOS, 1
        rows, live = np.concatenate([rows, filler]), np.concatenate([live, np.zeros(short)])
    out = []
    for i in range(0, len(rows), batch_size):
        b = prompt_batch(rows[i : i + batch_size])
        on = np.arange(b["inputs"].shape[1])[None] < b["length"][:, None]
        out.append({**b, "mask": (on * live[i : i + batch_size, None]).astype(np.float32)})
    return out


def check_prompt_batch(batch: dict[str, np.ndarray]) -> None:
    width = batch["inputs"].shape[1]
    lengths = batch["length"]
    if (lengths < 4).any() or (lengths > width).any() or (batch["inputs"][:, 0] != BOS).any():
        raise TpulabError(
            f"a PPO prompt batch holds a row that is not BOS SOH prompt STX <= {width}"
        )


# --- the frozen models ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Frozen:
    params: object  # host arrays
    digest: str  # sha256 of the checkpoint's manifest
    record: dict


def check_same_model(what: str, path, saved: dict, config: RunConfig) -> None:
    """A frozen model must have this run's shape, precision and tokenizer (its raw config)."""
    for section in ("model", "precision"):
        have, want = saved.get("config", {}).get(section, {}), to_dict(getattr(config, section))
        diff = [
            f"{section}.{k}: {have.get(k)!r} there, {v!r} here"
            for k, v in want.items()
            if have.get(k) != v
        ]
        if diff:
            raise TpulabError(
                f"{what} {path} holds a model of another shape ({'; '.join(diff[:3])})"
            )
    if saved.get("tokenizer") != TOKENIZER:
        raise TpulabError(f"{what} {path} was trained with another tokenizer")


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
    if kind != "reward":
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


def load_language_model(config: RunConfig, key: str) -> Frozen:
    """A fresh host copy of the language model ``objective.<key>`` names (init, reference)."""
    restored = named(key, lambda: load_base(config, key))
    record = {
        "run_dir": str(getattr(config.objective, key) or config.objective.init),
        "step": restored.step,
        "checkpoint_digest": restored.checkpoint_digest,
    }
    return Frozen(jax.device_get(restored.plain_params()), restored.checkpoint_digest, record)


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
        self.tx, self.schedule = optimizer(config.optim), lr_schedule(config.optim)
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
        rows = self.rows_at(rnd)
        (value, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(state.params, rnd, rows)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": value,
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state.step),
            **aux,
            **self.round_stats(rnd),
        }
        rnd = rnd._replace(position=(rnd.position + 1) % self.z.per_round)
        return PPOState(state.step + 1, params, opt_state, rng, rnd), metrics

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
        """``load_params()``: a fresh host copy of the starting parameters (read each time the
        state is initialised, so no caller's buffer is donated); ``frozen``: host arrays."""
        cfg = self.config
        replicated = NamedSharding(mesh, P())
        shapes = jax.eval_shape(lambda: start_state(cfg, self.abstract_params))
        state_sharding = sharding.state_shardings(shapes, mesh)
        batch_sharding = NamedSharding(mesh, sharding.BATCH_SPEC)
        frozen_sharding = sharding.state_shardings(frozen, mesh)
        frozen = jax.device_put(frozen, frozen_sharding)
        started = jax.jit(
            lambda params: start_state(cfg, params),
            in_shardings=(state_sharding.params,),
            out_shardings=state_sharding,
        )
        train = jax.jit(
            self.train_step,
            in_shardings=(state_sharding, frozen_sharding, batch_sharding, replicated),
            out_shardings=(state_sharding, replicated),
            donate_argnums=0,
        )
        evaluation = jax.jit(
            self.evaluate,
            in_shardings=(state_sharding.params, frozen_sharding, batch_sharding),
            out_shardings=replicated,
        )
        return Steps(
            graphdef=self.graphdef,
            tx=self.tx,
            mesh=mesh,
            init=lambda: started(load_params()),
            train=Bound(Train(train, self.z.per_round), frozen),
            eval=Bound(Evaluate(evaluation), frozen),
            state_sharding=state_sharding,
            batch_sharding=batch_sharding,
            all_finite=jax.jit(
                tree_all_finite, in_shardings=(state_sharding,), out_shardings=replicated
            ),
            model=lambda params: policy_module(cfg, params),
            frozen=frozen,
            state_shapes=shapes,
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


class PPO(Objective):
    kind = "ppo"

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


__all__ = ["PPO", "Fns", "load_reward_model", "build_prompts", "prompt_dataset"]
