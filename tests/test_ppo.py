"""PPO-RLHF on the one loop: ratio exactly 1, the sampler's distribution, reward placement, frozen
models, identities, bad input, no recompiles, and kill/resume in the middle of a round.

Sizes are tiny: the session's ``trained_run`` (tiny pretraining) is the init and the reference;
the reward model is that Transformer with a seeded scalar head, written through the checkpoint
store (``ppo_helpers``); a round is 8 rollouts of at most 8 new bytes for 4 prompts, 2 epochs x 2
minibatches (4 loop steps). Each proof has a negative control that makes it fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, frozen_tamper_error, one_kill_chaos, run_cli, tiny_config
from ppo_helpers import ppo_config, ppo_sets, write_lm, write_reward_model
from tpulab.checkpoint.files import MANIFEST
from tpulab.checkpoint.store import read_meta
from tpulab.compile_cache import count_compiles
from tpulab.data import dialogue
from tpulab.data.preference import gold_reward
from tpulab.data.tokenizer import BOS, PAD
from tpulab.errors import ConfigError, TpulabError
from tpulab.evidence.ledger import read_ledger
from tpulab.evidence.metrics import read_records
from tpulab.train.loop import train
from tpulab.train.objectives import build
from tpulab.train.objectives.frozen import load_base, load_language_model, load_reward_model
from tpulab.train.objectives.ppo import _gold_host
from tpulab.train.objectives.ppo_state import RoundState, abstract_state
from tpulab.train.restore import load_model
from tpulab.train.step import make_mesh, tree_digest, words_digest


@pytest.fixture(scope="session")
def reward_run(trained_run, tmp_path_factory) -> Path:
    return write_reward_model(trained_run, tmp_path_factory.mktemp("rm") / "run")


@pytest.fixture(scope="session")
def ppo_run(trained_run, reward_run, tmp_path_factory) -> Path:
    """3 rounds of 4 steps (12 steps), checkpoints every 3 steps: inside rounds."""
    run = tmp_path_factory.mktemp("ppo") / "run"
    train(ppo_config(trained_run, reward_run), run, progress=False)
    return run


def step_records(run: Path) -> list[dict]:
    return [r for r in read_records(run) if "step" in r and "event" not in r]


def final_round(run: Path):
    return jax.device_get(load_model(run).state.round)


# --- ratio exactly 1, the behaviour policy -------------------------------------------------------


def test_the_ratio_is_exactly_one_on_the_first_minibatch_of_every_round(ppo_run):
    recs = step_records(ppo_run)
    assert [r["round"] for r in recs] == [1] * 4 + [2] * 4 + [3] * 4
    assert [r["position"] for r in recs] == [0, 1, 2, 3] * 3
    firsts = [r for r in recs if r["position"] == 0]
    # every token's log-ratio is exactly 0.0, so every ratio is exactly 1.0
    assert all(r["log_ratio_max"] == 0.0 and r["ratio_dev_max"] == 0.0 for r in firsts)
    # control: the same metric moves once an update with lr > 0 changed the policy
    later = [r for r in recs if r["position"] >= 2]
    assert all(r["log_ratio_max"] > 1e-4 for r in later)


def test_the_behaviour_digest_names_the_weights_that_sampled_each_round(trained_run, ppo_run):
    recs = step_records(ppo_run)
    by_round = {}
    for r in recs:
        by_round.setdefault(r["round"], set()).add(r["behaviour_sha256"])
    assert all(len(v) == 1 for v in by_round.values())  # one behaviour policy per round
    digests = [next(iter(by_round[k])) for k in (1, 2, 3)]
    assert len(set(digests)) == 3  # the policy moved between rounds
    assert digests[0] == tree_digest(load_model(trained_run).plain_params())  # round 1: the init
    # the checkpoint records the round's behaviour digest in its state
    assert words_digest(final_round(ppo_run).behaviour_sha256) == digests[2]
    # the policy read back from the run is a language model (what generate would load)
    assert tree_digest(load_model(ppo_run).plain_params()) not in digests


def test_the_sampler_and_trainer_score_the_same_distribution(trained_run, reward_run, ppo_run):
    """The sampler's own log-probs of the tokens it drew equal the trainer's recomputation (gap
    0.0 measured, bound 1e-5: the cached decode path against the full forward, fp32). Control:
    replies drawn at another temperature than the trainer scores at are caught by the same gap,
    and had the old log-probs been the sampler's, the first ratio would not be 1."""
    assert all(r["sampler_gap"] <= 1e-5 for r in step_records(ppo_run))
    cfg = ppo_config(trained_run, reward_run)
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    state = steps.init()
    batch = steps.put_batch(next(iter(obj.data().train(0, 1))))
    fns = obj.fns

    @jax.jit
    def first_minibatch(params, rng, frozen, batch, t_sample):
        words = jnp.zeros((8,), jnp.uint32)
        _, rnd = fns.start_round(params, rng, frozen, batch, 1, words, sample_temperature=t_sample)
        rows = fns.rows_at(rnd)
        logp, _, _ = fns.forward(params, rnd.tokens[rows])
        return rnd, rows, logp

    for t_sample in (1.0, 2.0):
        rnd, rows, logp = jax.device_get(
            first_minibatch(state.params, state.rng, steps.frozen, batch, t_sample)
        )
        m = rnd.mask > 0
        gap = np.max(np.abs(rnd.sampler_logp - rnd.old_logp)[m])
        on = rnd.mask[rows] > 0
        assert np.array_equal(logp[on], rnd.old_logp[rows][on])  # ratio 1, at either temperature
        sampler_ratio = np.exp(logp - rnd.sampler_logp[rows])[on]
        if t_sample == cfg.objective.ppo.temperature:
            assert gap <= 1e-5
        else:
            assert gap > 0.05 and np.max(np.abs(sampler_ratio - 1.0)) > 0.05


# --- the round's contents ------------------------------------------------------------------------


def test_the_round_holds_rollouts_scored_at_their_last_reply_byte(trained_run, reward_run, ppo_run):
    cfg = ppo_config(trained_run, reward_run)
    rnd = final_round(ppo_run)
    lengths = np.argmax(rnd.mask > 0, axis=1) + 1  # BOS SOH prompt STX: the first reply token
    n = rnd.length
    assert (n >= 1).all() and (n <= cfg.objective.ppo.max_new).all()
    assert (rnd.mask.sum(axis=1) == n).all()
    t1 = rnd.tokens.shape[1]
    for row, start, k in zip(rnd.tokens, lengths, n):
        assert row[start - 1] == dialogue.RESPONSE_START and (row[start + k :] == PAD).all()
        assert t1 >= start + k
    assert rnd.score.dtype == np.float32
    fns = build(cfg).fns
    rm = load_reward_model(cfg).params
    read = jnp.asarray(lengths + n - 1)
    score = jax.jit(fns.score)(rm, jnp.asarray(rnd.tokens), read)
    np.testing.assert_allclose(np.asarray(score), rnd.score, rtol=1e-6, atol=1e-6)
    # bytes after the last reply byte change nothing (causal reads); the byte at it does
    noisy = rnd.tokens.copy()
    after = np.arange(t1)[None] > (lengths + n - 1)[:, None]
    noisy[after] = 65
    same = jax.jit(fns.score)(rm, jnp.asarray(noisy), read)
    assert np.array_equal(np.asarray(same), np.asarray(score))
    moved = jax.jit(fns.score)(rm, jnp.asarray(rnd.tokens), jnp.maximum(read - 1, 0))
    assert not np.allclose(np.asarray(moved), np.asarray(score), atol=1e-4)  # control
    # the reward: minus the KL penalty on every token, plus the score at the last one
    kl = (rnd.old_logp - rnd.ref_logp) * rnd.mask  # k1, the default estimator
    want = -cfg.objective.ppo.kl_coef * kl
    want[np.arange(len(n)), lengths + n - 2] += rnd.score
    np.testing.assert_allclose(rnd.rewards, want * rnd.mask, rtol=1e-6, atol=1e-7)
    on = rnd.advantages[rnd.mask > 0]
    assert abs(on.mean()) < 1e-5 and abs(on.std() - 1.0) < 1e-3  # whitened over the round


def test_the_evaluation_gold_reward_is_r_star_of_the_sampled_bytes(trained_run, reward_run):
    """The evaluation's replies, decoded here from the prompts' own text: val_gold_reward is the
    mean r* of their bytes (control: r* of the replies without their first byte differs)."""
    cfg = ppo_config(trained_run, reward_run)
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    params = steps.init().params
    texts = obj.prompts.eval
    batch = obj.data().eval_batches[0]
    out = steps.eval(params, steps.put_global(batch))
    _, (tokens, lengths, n) = jax.device_get(
        steps.eval.fn.fn(params, steps.frozen, steps.put_global(batch))
    )
    want, shifted = [], []
    for row, start, k, text in zip(tokens, lengths, n, texts):
        assert (row[:start] == text[:start]).all()
        prompt = bytes(int(x) for x in text[2 : start - 1])
        reply = bytes(int(x) if x < 256 else 0 for x in row[start : start + k])
        want.append(gold_reward(prompt, reply))
        shifted.append(gold_reward(prompt, reply[1:]))
    assert len(want) == int(out["val_gold_reward"][1]) == min(len(texts), 4)
    assert float(out["val_gold_reward"][0]) == pytest.approx(sum(want), abs=1e-6)
    # the host decoding itself, on a reply whose r* is known: it stops (+1), one verse-like line
    # (+1) naming the cue's speaker (+0.5); a BOS or PAD token in a reply is not text (-1)
    prompt = b"KING.\nHow now?\n\nHAMLET.\n"
    ids = [BOS, dialogue.PROMPT_START, *prompt, dialogue.RESPONSE_START]
    reply = b"Not so, my good king, not so at all.\x03"
    rows = np.full((2, 64), PAD, np.int32)
    rows[:, : len(ids)] = ids
    rows[:, len(ids) : len(ids) + len(reply)] = list(reply)
    rows[1, len(ids) + 3] = PAD
    got = _gold_host(rows, np.full(2, len(ids)), np.full(2, len(reply)))
    assert got[0] == gold_reward(prompt, reply) == 2.5 and got[1] == 1.5
    # control: a reply read from one position early (STX, a control byte, leads it) scores less
    early = _gold_host(rows[:1], np.array([len(ids) - 1]), np.array([len(reply) + 1]))
    assert early[0] != got[0]


def test_every_step_of_a_round_sees_its_prompts_and_evaluations_are_logged(ppo_run):
    train_rows = read_ledger(ppo_run)["train"]
    rounds = [tuple(train_rows[s]) for s in range(1, 13)]
    assert len(set(rounds[0:4])) == len(set(rounds[4:8])) == len(set(rounds[8:12])) == 1
    assert len({rounds[0], rounds[4], rounds[8]}) == 3
    evals = [r for r in read_records(ppo_run) if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [4, 8, 12]
    keys = ("val_reward", "val_gold_reward", "val_kl", "val_response_length")
    assert all(all(np.isfinite(e[k]) for k in keys) for e in evals)
    recs = step_records(ppo_run)
    assert recs[-1]["kl"] > 0.0 and recs[0]["kl"] == 0.0  # round 1: the policy is the reference


def test_the_step_compiles_once_across_round_starts(trained_run, reward_run):
    cfg = ppo_config(trained_run, reward_run)
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    it = obj.data().train(0, 1)
    state = steps.init()
    state, m = steps.train(state, steps.put_batch(next(it)))  # warm-up (a round start)
    jax.block_until_ready(m)
    with count_compiles() as compiles:
        for _ in range(5):  # positions 1, 2, 3, then a round start, then 1
            state, m = steps.train(state, steps.put_batch(next(it)))
        jax.block_until_ready(m)
    assert compiles["n"] == 0 and steps.train._cache_size() == 1
    assert int(m["round"]) == 2 and int(m["position"]) == 1


# --- frozen models and identities ----------------------------------------------------------------


def test_reference_and_reward_model_are_bitwise_unchanged(trained_run, reward_run, ppo_run):
    cfg = ppo_config(trained_run, reward_run)
    from tpulab.checkpoint.rundir import RunDir

    summary = RunDir(ppo_run).read_summary()
    fresh = {
        "reference": jax.device_get(load_model(trained_run).plain_params()),
        "reward": load_reward_model(cfg).params,
    }
    assert summary.frozen_sha256 == tree_digest(fresh)
    ids = summary.identities
    meta = read_meta(load_model(ppo_run).checkpoint_dir)
    assert meta["identities"] == ids
    assert set(ids) == {"init", "reference", "reward_model", "dataset"}
    assert ids["init"] == ids["reference"] == load_model(trained_run).checkpoint_digest
    assert ids["reward_model"] != ids["init"]


def test_a_changed_reward_model_is_caught_at_the_end_of_the_run(trained_run, reward_run, tmp_path):
    """Negative control for the frozen check: a hook edits one reward-model weight mid-run."""
    cfg = ppo_config(trained_run, reward_run, "train.steps=2")

    def edit(frozen):
        leaf = frozen["reward"]["score"]["kernel"]
        leaf[...] = leaf[...] + 1.0

    assert frozen_tamper_error(cfg, tmp_path / "run", 1, edit).exit_code == 3


@pytest.fixture(scope="session")
def other_lm(trained_run, tmp_path_factory) -> Path:
    """The same shape as the init, trained 5 steps further: another checkpoint digest."""
    other = tmp_path_factory.mktemp("other_lm") / "run"
    shutil.copytree(trained_run, other)
    train(tiny_config("train.steps=45"), other, progress=False)
    return other


@pytest.mark.parametrize("change", ["init", "reference", "reward_model", "dataset"])
def test_a_resume_with_a_changed_identity_is_refused_and_changes_nothing(
    trained_run, reward_run, ppo_run, other_lm, tmp_path, change
):
    run = tmp_path / "run"
    shutil.copytree(ppo_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    sets = {"init": trained_run, "reward": reward_run, "extra": []}
    if change == "init":
        sets["init"] = other_lm
    elif change == "reference":
        sets["extra"] = [f"objective.reference={other_lm}"]
    elif change == "reward_model":
        sets["reward"] = write_reward_model(trained_run, tmp_path / "rm2", seed=1)
    else:
        pairs = tmp_path / "pairs.jsonl"
        lines = [{"prompt": f"KING.\nSpeak {i}.\n\nHAM.\n", "response": "No."} for i in range(6)]
        pairs.write_text("".join(json.dumps(x) + "\n" for x in lines))
        sets["extra"] = [f"objective.data={pairs}"]
    cfg = ppo_config(sets["init"], sets["reward"], "train.steps=16", *sets["extra"])
    with pytest.raises(TpulabError, match=f"refusing to resume step 12: .*{change}"):
        train(cfg, run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "rejected_checkpoints").exists()


# --- bad input -----------------------------------------------------------------------------------


def test_bad_reference_or_reward_model_is_one_line(trained_run, reward_run, tmp_path):
    def refused(match, **paths):
        init, rm = paths.get("init", trained_run), paths.get("rm", reward_run)
        extra = [f"objective.reference={paths['ref']}"] if "ref" in paths else []
        with pytest.raises(TpulabError, match=match) as e:
            build(ppo_config(init, rm, *extra))
        assert "\n" not in str(e.value)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(reward_run, corrupt)
    for step in (corrupt / "checkpoints").iterdir():
        (step / MANIFEST).write_text("{}")
    refused("holds no checkpoints", rm=tmp_path / "nowhere")
    refused("valid", rm=corrupt)
    refused("is not a reward model", rm=trained_run)
    refused(
        "another shape.*d_model",
        rm=write_reward_model(
            write_lm(trained_run, tmp_path / "wide", d_model=48), tmp_path / "rm_wide"
        ),
    )
    refused(
        "another tokenizer",
        rm=write_reward_model(trained_run, tmp_path / "rm_tok", tokenizer={"kind": "other"}),
    )
    refused("objective.reference.*holds no checkpoints", ref=tmp_path / "nowhere")
    refused("objective.reference .*another shape", ref=tmp_path / "wide")
    refused(
        "objective.reference .*another tokenizer",
        ref=write_lm(trained_run, tmp_path / "lm_tok", tokenizer={"kind": "other"}),
    )
    corrupt_lm = tmp_path / "corrupt_lm"
    shutil.copytree(trained_run, corrupt_lm)
    for step in (corrupt_lm / "checkpoints").iterdir():
        (step / MANIFEST).write_text("{}")
    refused("valid", ref=corrupt_lm)
    # control: the same call with good inputs builds
    assert build(ppo_config(trained_run, reward_run)).identities()["reward_model"]


def test_every_frozen_model_reader_ignores_remat_and_refuses_another_model(trained_run, tmp_path):
    """One check (``frozen.check_same_model``) for the init, the reference and the reward model.
    Its two copies once disagreed: SFT's ignored ``model.remat`` (it changes memory, not the
    model), PPO's refused a reward model trained under another remat. A PPO run with remat on
    reads all three models trained without it; control: a setting that does change the model
    (``rope_base``, the same parameter shapes) is refused by all three, naming the field."""
    rm = write_reward_model(trained_run, tmp_path / "rm")
    readers = {
        "init": lambda cfg: load_base(cfg),
        "reference": lambda cfg: load_language_model(cfg, "reference"),
        "reward_model": load_reward_model,
    }
    remat = ppo_config(trained_run, rm, "model.remat=block")
    for name, read in readers.items():
        assert read(remat), name
    other = ppo_config(trained_run, rm, "model.remat=block", "model.rope_base=500.0")
    for name, read in readers.items():
        with pytest.raises(TpulabError, match=f"objective.{name} .*model.rope_base: 10000.0 there"):
            read(other)


@pytest.mark.parametrize(
    "setting, why",
    [
        ("objective.ppo.clip=.inf", "must be a finite number|not finite"),
        ("objective.ppo.clip=1.5", "must be in \\(0, 1\\)"),
        ("objective.ppo.clip=0.0", "must be in \\(0, 1\\)"),
        ("objective.ppo.value_clip=-1.0", "must be > 0"),
        ("objective.ppo.gamma=1.5", "gamma=1.5 must be in \\[0, 1\\]"),
        ("objective.ppo.lam=-0.1", "lam=-0.1 must be in \\[0, 1\\]"),
        ("objective.ppo.temperature=0.0", "temperature"),
        ("objective.ppo.rollouts=6", "multiple of data.batch_size"),
        ("objective.ppo.minibatches=3", "not divisible"),
        ("objective.ppo.max_new=30", "no room"),
    ],
)
def test_bad_ppo_settings_are_one_line(trained_run, reward_run, setting, why):
    with pytest.raises(ConfigError, match=why):
        ppo_config(trained_run, reward_run, setting)


def test_ppo_fields_need_ppo_and_ppo_needs_a_reward_model(trained_run):
    with pytest.raises(ConfigError, match="needs objective.reward_model"):
        tiny_config("objective.kind=ppo", f"objective.init={trained_run}")
    with pytest.raises(ConfigError, match="objective.ppo applies to objective.kind=ppo"):
        tiny_config(
            "objective.kind=sft", f"objective.init={trained_run}", "objective.ppo.gamma=0.5"
        )


def test_bad_input_from_the_cli_is_one_line_and_writes_nothing(trained_run, reward_run, tmp_path):
    for extra, why in (
        (["objective.ppo.gamma=2.0"], "gamma"),
        ([f"objective.reward_model={tmp_path / 'nowhere'}"], "holds no checkpoints"),
    ):
        run = tmp_path / "run"
        sets = [*ppo_sets(trained_run, reward_run), *extra]
        args = (a for s in sets for a in ("--set", s))
        result = run_cli("train", "--run-dir", str(run), "--config", str(TINY), *args)
        assert result.returncode != 0 and why in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not run.exists()


# --- kill/resume proofs --------------------------------------------------------------------------


def test_a_ppo_verdict_names_the_round_it_compares(trained_run, ppo_run):
    """The verdict's list of what it compared is read from the state compared: a PPO run's names
    its round's every field (rollouts, old log-probs, advantages, keys, position); control: a
    pretraining run's names no round."""
    from tpulab.proofs.state import final_state_verdict

    text = final_state_verdict(ppo_run, ppo_run)["final_state_compared"]
    assert f"round ({', '.join(RoundState._fields)})" in text, text
    assert "optimizer state (count, mu, nu)" in text, text
    plain = final_state_verdict(trained_run, trained_run)["final_state_compared"]
    assert (
        plain == "step, parameters, optimizer state (count, mu, nu), RNG key, Grain data position"
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 3 processes each compiled PPO's step cold: 600 s ran out at load 18
def test_ppo_killed_in_the_middle_of_a_round_resumes_bitwise(
    trained_run, reward_run, ppo_run, tmp_path
):
    """The kill/resume proof (`tpulab prove-resume`'s driver, called here: its CLI is
    tests/test_sft.py's and the pretraining proof's), killed right after step 7 (round 2,
    position 2: after its rollouts, during its epochs), resumed from step 6 (round 2, position
    1): per-step losses and the whole final state (policy, value head, Adam, the round's
    buffers, keys and position, data position) bitwise against ``ppo_run`` (the same config,
    uninterrupted). The resumed process shares the warm compile cache (``ppo_run`` filled it):
    the cold resume is tests/test_sft.py's full-SFT proof."""
    from tpulab.proofs.transformer import prove_transformer_resume

    cfg = ppo_config(trained_run, reward_run)
    prove_transformer_resume(
        cfg, tmp_path, reference_dir=ppo_run, kill_at=7, warm_resume_cache=True, track=False
    )
    v = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["curves_identical"] and v["final_state_identical"]
    assert v["kill_step"] == 7 and v["resumed_from_step"] == 6 and v["steps_compared"] == 12
    assert v["reference_dir"] == str(ppo_run) and not (tmp_path / "proof" / "reference").exists()
    # the whole-state verdict covered every leaf of PPOState, the round's buffers and keys included
    assert v["leaves_compared"] == len(jax.tree.leaves(abstract_state(cfg, make_mesh())))
    resumed = read_meta(load_model(tmp_path / "proof" / "interrupted").checkpoint_dir)
    assert resumed["identities"]["reward_model"] == load_reward_model(cfg).digest


@pytest.mark.slow
def test_ppo_chaos_random_kills_end_identical(trained_run, reward_run, ppo_run, tmp_path):
    """`tpulab chaos`'s driver, called here: one random kill (the fixed-point proof above covers
    the rest; 2 cost ~60 s more); the reference is ``ppo_run``, the same config trained once."""
    one_kill_chaos(ppo_config(trained_run, reward_run), tmp_path, ppo_run, seed=3)
