"""The reward model on the one loop: where the reward is read, its type, its start from SFT, its
identities and its kill/resume. Each proof has a negative control. Tiny sizes; the SFT policy and
its sampled pairs are the session's ``sft_policy`` and ``sampled_pairs`` (read only)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from tpulab.data import preference as P
from tpulab.errors import ConfigError, TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.model.value import ScalarHeadModel, scalar_head_graph
from tpulab.train.loop import train
from tpulab.train.objectives import build
from tpulab.train.restore import load_model
from tpulab.train.step import make_mesh, merge_model, tree_digest

SEQ = tiny_config().data.seq_len


def reward_sets(sft, pairs, *extra: str) -> list[str]:
    return [
        "objective.kind=reward",
        f"objective.init={sft}",
        f"objective.data={pairs}",
        "train.steps=8",
        "train.eval_every=4",
        "checkpoint.save_every=4",
        *extra,
    ]


# synchronous saves: the proof's kill after step 5 must find step 4 committed (tests/test_dpo.py)
SYNC = "checkpoint.async_save=false"


@pytest.fixture(scope="module")
def reward_run(sft_policy, sampled_pairs, tmp_path_factory):
    """8 steps, in-process; also the uninterrupted reference of the kill/resume proof."""
    run = tmp_path_factory.mktemp("reward") / "run"
    train(tiny_config(*reward_sets(sft_policy, sampled_pairs, SYNC)), run, progress=False)
    return run


def short_batch(n: int = 8) -> dict:
    """Pairs of short replies, so every row has padding after its stop byte."""
    rng = np.random.default_rng(1)
    prefs = [
        P.Pref(b"K.\nWho?\n\nH.\n", bytes(rng.integers(97, 123, 1 + i % 5).tolist()), b"No", "t")
        for i in range(n)
    ]
    return P.to_batch(P.encode(prefs, SEQ), np.arange(n))


def random_scorer(precision: str = "float32"):
    """A jitted (tokens, read) -> rewards of a randomly initialised reward model."""
    cfg = tiny_config(f"precision.compute_dtype={precision}")
    graphdef, _, init = scalar_head_graph(cfg.model, cfg.precision, 0)
    params = init()
    fn = jax.jit(lambda t, r: merge_model(graphdef, params).scores_at(t, r))
    return lambda t, r: np.asarray(fn(jnp.asarray(t), jnp.asarray(r)))


# --- where and in what type the reward is read --------------------------------------------------


def test_bytes_after_the_stop_byte_change_nothing_and_the_last_position_would():
    score, batch = random_scorer(), short_batch()
    tokens, read = batch["inputs"], batch["read"]
    noise = np.random.default_rng(0).integers(0, 256, tokens.shape)
    after = np.arange(SEQ)[None, :] > read[:, None]
    assert after.any(axis=1).all()  # every row has bytes after its stop byte to change
    changed = np.where(after, noise, tokens)
    r = score(tokens, read)
    assert r.dtype == np.float32
    assert score(changed, read).tobytes() == r.tobytes()
    # negative control: read at the last position (as with trl#3750's first pad), it changes
    last = np.full_like(read, SEQ - 1)
    assert (score(changed, last) != score(tokens, last)).all()


def test_the_reward_is_float32_with_bfloat16_compute():
    cfg = tiny_config("precision.compute_dtype=bfloat16")
    graphdef, _, init = scalar_head_graph(cfg.model, cfg.precision, 0)
    model, batch = merge_model(graphdef, init()), short_batch()
    out = jax.eval_shape(lambda t, r: model.scores_at(t, r), batch["inputs"], batch["read"])
    assert out.dtype == jnp.float32 and model.score.kernel[...].dtype == jnp.float32
    hidden = jax.eval_shape(lambda t: model.trunk(t), batch["inputs"])
    assert hidden.dtype == jnp.bfloat16  # control: the body itself does run in bfloat16


# --- the run ------------------------------------------------------------------------------------


def test_the_reward_model_starts_from_sft_with_a_seeded_head(sft_policy, sampled_pairs):
    cfg = tiny_config(*reward_sets(sft_policy, sampled_pairs))
    steps = build(cfg).steps(make_mesh(cfg))
    params = steps.init().params
    assert tree_digest(params["body"]) == tree_digest(load_model(sft_policy).state.params)
    other = build(tiny_config(*reward_sets(sft_policy, sampled_pairs), "seed=1"))
    assert tree_digest(other.steps(make_mesh(cfg)).init().params["score"]) != tree_digest(
        params["score"]
    )  # control: another seed, another head
    assert float(jnp.abs(params["score"]["kernel"][...]).max()) > 0


def test_a_reward_run_logs_its_metrics_and_loads_back_as_a_reward_model(
    reward_run, sft_policy, sampled_pairs
):
    recs = read_records(reward_run)
    first = next(r for r in recs if r.get("step") == 1)
    assert {"loss", "accuracy", "margin", "reward_mean"} <= set(first)
    evals = [r for r in recs if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    want = P.gold_optimal_accuracy(list(P.read_dir(sampled_pairs, tiny_config().data).eval))
    for e in evals:
        assert 0.0 <= e["val_accuracy"] <= 1.0 and np.isfinite(e["val_loss"])
        assert e["val_gold_optimal_accuracy"] == pytest.approx(want, rel=1e-6)
    restored = load_model(reward_run)
    assert isinstance(restored.model, ScalarHeadModel) and restored.step == 8
    meta = json.loads((restored.checkpoint_dir / "meta" / "metadata").read_text())
    ids = meta["identities"]
    assert ids["base"] == load_model(sft_policy).checkpoint_digest
    assert ids["dataset"] == P.read_dir(sampled_pairs, tiny_config().data).identity
    batch = short_batch(4)
    r = restored.model.scores_at(jnp.asarray(batch["inputs"]), jnp.asarray(batch["read"]))
    assert r.shape == (8,) and r.dtype == jnp.float32 and bool(jnp.isfinite(r).all())


def test_ppo_reads_the_reward_objectives_model_and_scores_as_it_does(reward_run, sft_policy):
    """The chain's hand-off: PPO's one reader of ``objective.reward_model`` takes a checkpoint the
    reward objective wrote (not a test-made one) and scores it with the very function the reward
    objective trained (one class, ``ScalarHeadModel.scores_at``): bitwise the reward model's own
    rewards; control: a read one position earlier differs."""
    from ppo_helpers import ppo_config
    from tpulab.train.objectives.frozen import load_reward_model
    from tpulab.train.objectives.ppo_state import value_graph

    cfg = ppo_config(sft_policy, reward_run)
    frozen = load_reward_model(cfg)
    restored = load_model(reward_run)
    assert frozen.digest == restored.checkpoint_digest and frozen.record["step"] == 8
    graphdef, _ = value_graph(cfg)
    scorer: ScalarHeadModel = nnx.merge(graphdef, frozen.params)
    batch = short_batch(4)
    tokens, read = jnp.asarray(batch["inputs"]), jnp.asarray(batch["read"])
    want = np.asarray(restored.model.scores_at(tokens, read))
    assert np.asarray(scorer.scores_at(tokens, read)).tobytes() == want.tobytes()
    earlier = np.asarray(scorer.scores_at(tokens, read - 1))
    assert np.abs(earlier - want).max() > 1e-3, (earlier, want)


def test_a_reward_resume_with_another_dataset_or_base_is_refused_and_moves_nothing(
    reward_run, sft_policy, sampled_pairs, trained_run, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(reward_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    natural = reward_sets(sft_policy, sampled_pairs, "train.steps=12")
    natural = [s for s in natural if not s.startswith("objective.data")]
    with pytest.raises(TpulabError, match="refusing to resume step 8: .*dataset"):
        train(tiny_config(*natural), run, progress=False)
    base = tmp_path / "base"
    shutil.copytree(sft_policy, base)
    train(
        tiny_config("objective.kind=sft", f"objective.init={trained_run}", "train.steps=14"),
        base,
        progress=False,
    )  # the SFT run trains on: objective.init now names another model
    moved = reward_sets(base, sampled_pairs, "train.steps=12")
    with pytest.raises(TpulabError, match="refusing to resume step 8: .*base"):
        train(tiny_config(*moved), run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "rejected_checkpoints").exists()
    # control: the same inputs resume
    train(tiny_config(*reward_sets(sft_policy, sampled_pairs, "train.steps=9")), run)
    assert load_model(run).step == 9


def test_a_reward_model_is_no_init_or_reference_for_a_policy(reward_run, sft_policy):
    with pytest.raises(TpulabError, match="objective.init .* is a reward model"):
        build(tiny_config("objective.kind=dpo", f"objective.init={reward_run}"))
    with pytest.raises(TpulabError, match="objective.reference .* is a reward model"):
        build(
            tiny_config(
                "objective.kind=dpo",
                f"objective.init={sft_policy}",
                f"objective.reference={reward_run}",
            )
        )


def test_reward_config_errors_are_one_line(sft_policy):
    for sets, why in (
        (["objective.lora.rank=4"], "trains every parameter"),
        (["objective.reward.margin=-1"], "must be >= 0"),
        (["objective.reward.centering=-0.5"], "must be >= 0"),
        (["objective.dpo.beta=0.2"], "applies to objective.kind=dpo"),
        (["objective.reference=x"], "applies to objective.kind=dpo"),
    ):
        with pytest.raises(ConfigError, match=why):
            tiny_config("objective.kind=reward", f"objective.init={sft_policy}", *sets)
    with pytest.raises(ConfigError, match="applies to objective.kind=reward"):
        tiny_config(
            "objective.kind=sft", f"objective.init={sft_policy}", "objective.reward.margin=1"
        )


@pytest.mark.slow
def test_reward_kill_resume_is_bitwise(sft_policy, sampled_pairs, reward_run, tmp_path):
    """The kill/resume proof (`tpulab prove-resume`'s driver, called here: its CLI is
    tests/test_sft.py's and the pretraining proof's) on the reward model, killed after step 5 of
    8 (resumed from 4, the saves of steps 4 and 8 on either side, an evaluation in each segment):
    per-step metrics and the whole final state (body, head, Adam moments, step, key, data
    position) bitwise against ``reward_run`` (the same config, uninterrupted, in-process). The
    resumed process shares the warm compile cache: the cold resume is tests/test_sft.py's
    full-SFT proof."""
    from tpulab.proofs.transformer import prove_transformer_resume

    cfg = tiny_config(*reward_sets(sft_policy, sampled_pairs, SYNC))
    prove_transformer_resume(
        cfg, tmp_path, reference_dir=reward_run, warm_resume_cache=True, track=False
    )
    v = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["curves_identical"] and v["final_state_identical"]
    assert v["steps_compared"] == 8 and v["kill_step"] == 5 and v["resumed_from_step"] == 4
    assert v["reference_dir"] == str(reward_run) and not (tmp_path / "proof" / "reference").exists()
