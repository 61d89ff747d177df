"""DPO on the one loop: the step-0 invariant, a reference that is never the policy, identities,
variants, bad input and kill/resume. Each proof has a negative control. Tiny sizes; the SFT policy
(``sft_policy``) is both the init and, by default, the reference.

Step 0, and how exact it is: dropout is off in DPO (TRL's default), so at step 0 the policy
computes what the reference computes. Measured on XLA:CPU at the tiny size, in both reference
modes (precomputed at the step's batch shape, or online in the same program) and with LoRA, every
reply's log-prob under the policy equals the reference's bit for bit, so every margin is exactly
0.0 and the loss exactly float32(ln 2) = 0.693147182... (the mean is taken as ln 2 plus the mean
deviation, which a float32 sum of equal terms would otherwise miss by up to 5 ulps). That is what
the test asserts: equality, not a tolerance. Float32 itself guarantees less: two programs may sum
a reply's log-probs in another order, up to about 2 S eps |log p| = 2e-4 nats here; a compiler
that fused differently would make this test name that bound instead.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY, frozen_tamper_error, one_kill_chaos, run_cli, tiny_config
from tpulab.errors import ConfigError, TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.train.loop import train
from tpulab.train.objectives import build
from tpulab.train.restore import load_model
from tpulab.train.step import make_mesh, tree_digest

LN2 = float(np.float32(np.log(2.0)))


def dpo_sets(sft, pairs, *extra: str) -> list[str]:
    return [
        "objective.kind=dpo",
        f"objective.init={sft}",
        f"objective.data={pairs}",
        "train.steps=8",
        "train.eval_every=4",
        "checkpoint.save_every=4",
        *extra,
    ]


@pytest.fixture(scope="module")
def dpo_run(sft_policy, sampled_pairs, tmp_path_factory):
    run = tmp_path_factory.mktemp("dpo") / "run"
    train(tiny_config(*dpo_sets(sft_policy, sampled_pairs)), run, progress=False)
    return run


def first_step(cfg):
    """The objective's own jitted train step, once, from its initial state: step 1's metrics."""
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    batch = steps.put_batch(next(obj.data().train(0, 1)))
    return {k: float(v) for k, v in jax.device_get(steps.train(steps.init(), batch)[1]).items()}


def buffer_pointers(tree) -> set[int]:
    return {
        shard.data.unsafe_buffer_pointer()
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
    }


# --- step 0 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [(), ("objective.dpo.reference_logprobs=online",), ("objective.lora.rank=4",)],
    ids=["precomputed", "online", "lora"],
)
def test_at_step_0_the_loss_is_ln2_and_every_margin_is_0(sft_policy, sampled_pairs, extra):
    m = first_step(tiny_config(*dpo_sets(sft_policy, sampled_pairs, *extra)))
    assert m["loss"] == LN2
    assert m["reward_margin_absmax"] == 0.0 and m["kl_ref"] == 0.0
    assert m["reward_chosen"] == m["reward_rejected"] == 0.0
    assert m["grad_norm"] > 0  # the loss is flat in value, not in its gradient


def test_a_reference_that_is_not_the_policy_breaks_the_step_0_invariant(
    sft_policy, sampled_pairs, trained_run
):
    """Negative control: the pretrained base as the reference (NeMo-Aligner#227: they differ)."""
    m = first_step(
        tiny_config(*dpo_sets(sft_policy, sampled_pairs), f"objective.reference={trained_run}")
    )
    assert m["loss"] != LN2 and m["reward_margin_absmax"] > 1e-3


def test_the_step_0_loss_is_read_from_metrics_jsonl(dpo_run):
    recs = [r for r in read_records(dpo_run) if "step" in r and "loss" in r]
    assert recs[0]["step"] == 1 and recs[0]["loss"] == LN2
    assert recs[-1]["loss"] != LN2  # control: training moves it
    keys = {"reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected", "kl_ref"}
    assert keys <= set(recs[0])
    evals = [r for r in read_records(dpo_run) if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    assert {"val_loss", "val_reward_accuracy", "val_kl_ref"} <= set(evals[-1])


# --- the reference: a separate, frozen copy ----------------------------------------------------


def test_the_reference_buffers_are_not_the_policys(sft_policy, sampled_pairs):
    cfg = tiny_config(*dpo_sets(sft_policy, sampled_pairs))
    steps = build(cfg).steps(make_mesh(cfg))
    state = steps.init()
    reference = steps.frozen["reference"]
    assert tree_digest(reference) == tree_digest(state.params)  # the same values ...
    assert not buffer_pointers(reference) & buffer_pointers(state.params)  # ... not the same memory
    # negative control: placing the policy's own arrays again aliases them (the check sees it)
    aliased = jax.device_put(state.params, steps.state_sharding.params)
    assert buffer_pointers(aliased) & buffer_pointers(state.params)


@pytest.mark.parametrize("leaf", ["reference", "reference_logprobs"])
def test_a_changed_reference_is_caught_at_the_end_of_the_run(
    sft_policy, sampled_pairs, tmp_path, leaf
):
    """Negative control of the loop's frozen check: a hook edits the reference mid-run (the run
    that is not tampered with, ``dpo_run``, ends normally)."""
    cfg = tiny_config(*dpo_sets(sft_policy, sampled_pairs), "train.steps=3")

    def edit(frozen):
        if leaf == "reference":
            w = frozen["reference"]["blocks"][0]["attn"]["qkv"]["kernel"]
            w[...] = w[...] + 1.0
        else:
            frozen["reference_logprobs"] = frozen["reference_logprobs"].at[0].add(1.0)

    assert frozen_tamper_error(cfg, tmp_path / "run", 2, edit).exit_code == 3


def test_a_dpo_run_records_its_identities_and_its_reference_ends_bitwise(
    dpo_run, sft_policy, sampled_pairs
):
    restored = load_model(dpo_run)
    meta = json.loads((restored.checkpoint_dir / "meta" / "metadata").read_text())
    ids = meta["identities"]
    sft = load_model(sft_policy)
    assert ids["base"] == ids["reference"] == sft.checkpoint_digest
    assert set(ids) == {"base", "reference", "dataset", "reference_logprobs"}
    from tpulab.checkpoint.rundir import RunDir

    summary = RunDir(dpo_run).read_summary()
    cfg = tiny_config(*dpo_sets(sft_policy, sampled_pairs))
    frozen = build(cfg).steps(make_mesh(cfg)).frozen
    assert summary.frozen_sha256 == tree_digest(frozen)  # the reference as it was read
    assert tree_digest(frozen["reference"]) == tree_digest(sft.state.params)
    assert tree_digest(restored.state.params) != tree_digest(sft.state.params)  # control: moved


def test_a_dpo_resume_with_any_identity_changed_is_refused_and_moves_nothing(
    dpo_run, sft_policy, sampled_pairs, trained_run, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(dpo_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    longer = "train.steps=12"
    moved_sft = tmp_path / "sft"
    shutil.copytree(sft_policy, moved_sft)
    train(
        tiny_config("objective.kind=sft", f"objective.init={trained_run}", "train.steps=14"),
        moved_sft,
        progress=False,
    )  # the SFT run trains on: its newest checkpoint is another model
    cases = {
        "reference": dpo_sets(
            sft_policy, sampled_pairs, longer, f"objective.reference={moved_sft}"
        ),
        "dataset": [s for s in dpo_sets(sft_policy, sampled_pairs, longer) if "data=" not in s],
        "base": dpo_sets(moved_sft, sampled_pairs, longer, f"objective.reference={sft_policy}"),
        "reference_logprobs": dpo_sets(
            sft_policy, sampled_pairs, longer, "objective.dpo.reference_logprobs=online"
        ),
    }
    for name, sets in cases.items():
        with pytest.raises(TpulabError, match=f"refusing to resume step 8: .*{name}"):
            train(tiny_config(*sets), run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "rejected_checkpoints").exists()
    train(tiny_config(*dpo_sets(sft_policy, sampled_pairs, "train.steps=9")), run)  # control
    assert load_model(run).step == 9


# --- variants ----------------------------------------------------------------------------------


def test_ipo_at_step_0_is_its_target_squared(sft_policy, sampled_pairs):
    m = first_step(
        tiny_config(
            *dpo_sets(sft_policy, sampled_pairs), "objective.dpo.loss=ipo", "objective.dpo.beta=0.1"
        )
    )
    assert m["loss"] == pytest.approx(25.0, rel=1e-6) and m["reward_margin_absmax"] == 0.0


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, why",
    [
        ("objective.dpo.beta=0", "beta=0"),
        ("objective.dpo.beta=-0.1", "beta=-0.1"),
        ("objective.dpo.beta=1000", "must be in"),
        ("objective.dpo.beta=.nan", "finite"),
        ("objective.dpo.label_smoothing=0.5", "label_smoothing=0.5"),
        ("objective.dpo.loss=hinge", "hinge"),
        ("objective.reward.margin=1", "applies to objective.kind=reward"),
    ],
)
def test_dpo_config_errors_are_one_line(sft_policy, bad, why):
    with pytest.raises(ConfigError, match=why):
        tiny_config("objective.kind=dpo", f"objective.init={sft_policy}", bad)


def test_ipo_refuses_label_smoothing(sft_policy):
    with pytest.raises(ConfigError, match="applies to loss=sigmoid"):
        tiny_config(
            "objective.kind=dpo",
            f"objective.init={sft_policy}",
            "objective.dpo.loss=ipo",
            "objective.dpo.label_smoothing=0.1",
        )
    tiny_config(
        "objective.kind=dpo", f"objective.init={sft_policy}", "objective.dpo.label_smoothing=0.1"
    )


def test_a_missing_corrupt_or_foreign_reference_is_one_line(sft_policy, sampled_pairs, tmp_path):
    from tpulab.checkpoint.files import MANIFEST, write_manifest

    base = dpo_sets(sft_policy, sampled_pairs)
    with pytest.raises(TpulabError, match="holds no checkpoints"):
        build(tiny_config(*base, f"objective.reference={tmp_path / 'nowhere'}"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(sft_policy, corrupt)
    for step in (corrupt / "checkpoints").iterdir():
        (step / MANIFEST).write_text("{}")
    with pytest.raises(TpulabError, match="valid"):
        build(tiny_config(*base, f"objective.reference={corrupt}"))
    # a well-formed checkpoint (its manifest rewritten to match) of another tokenizer
    foreign = tmp_path / "foreign"
    shutil.copytree(sft_policy, foreign)
    for step in (foreign / "checkpoints").iterdir():
        meta_file = step / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        meta["tokenizer"] = {**meta["tokenizer"], "bos": 1}
        meta_file.write_text(json.dumps(meta))
        old = json.loads((step / MANIFEST).read_text())
        write_manifest(step, {k: v for k, v in old.items() if k not in ("format", "files")})
    with pytest.raises(TpulabError, match="objective.reference .* another tokenizer"):
        build(tiny_config(*base, f"objective.reference={foreign}"))
    build(tiny_config(*base, f"objective.reference={sft_policy}"))  # control


def test_a_reference_of_another_shape_is_refused(sft_policy, sampled_pairs, tmp_path):
    from ppo_helpers import write_lm

    # an untrained d_model=64 model written through the checkpoint store (training it changed
    # nothing the refusal reads: the checkpoint's config and arrays)
    other = write_lm(sft_policy, tmp_path / "other", d_model=64)
    with pytest.raises(TpulabError, match="objective.reference .*another shape.*d_model"):
        build(tiny_config(*dpo_sets(sft_policy, sampled_pairs), f"objective.reference={other}"))


def test_bad_dpo_input_from_the_cli_is_one_line_and_writes_nothing(sft_policy, tmp_path):
    same = tmp_path / "same.jsonl"
    line = json.dumps({"prompt": "Who?", "chosen": "Me.", "rejected": "Me."})
    same.write_text(line + "\n")
    run = tmp_path / "run"
    for sets, why in (
        ([f"objective.data={same}"], "chosen equals rejected"),
        (["objective.dpo.beta=-1"], "beta"),
        ([f"objective.reference={tmp_path / 'gone'}"], "holds no checkpoints"),
    ):
        args = ["--set", "objective.kind=dpo", "--set", f"objective.init={sft_policy}"]
        args += [a for s in sets for a in ("--set", s)]
        r = run_cli("train", "--run-dir", str(run), "--config", str(TINY), *args)
        assert r.returncode != 0 and why in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not run.exists()


# --- the win rate ------------------------------------------------------------------------------


def test_the_gold_win_rate_counts_wins_by_r_star_and_a_policy_ties_itself(
    sft_policy, dpo_run, trained_run
):
    from tpulab.posttrain.winrate import win_rate

    same = win_rate(sft_policy, sft_policy, max_prompts=8)
    assert same["win_rate"] == 0.5 and same["ties"] == same["prompts"] == 8
    assert all(r["policy"] == r["against"] for r in same["replies"])
    result = win_rate(dpo_run, sft_policy, max_prompts=8)
    a = np.array([r["policy_gold"] for r in result["replies"]])
    b = np.array([r["against_gold"] for r in result["replies"]])
    assert result["win_rate"] == np.mean(a > b) + 0.5 * np.mean(a == b)
    assert result["policy"]["objective"] == "dpo" and result["against"]["objective"] == "sft"
    # negative control: another policy (the pretrained base) replies otherwise
    other = win_rate(trained_run, sft_policy, max_prompts=8)
    assert any(r["policy"] != r["against"] for r in other["replies"])


# --- kill/resume -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)  # it may be the one to build the chain: the chain test's limit
def test_dpo_kill_resume_is_bitwise(preference_chain):
    """The kill/resume proof on DPO: the preference chain's (``preference_chain``, shared with
    tests/test_sft_eval.py; `prove-resume`'s driver, whose CLI is tests/test_sft.py's and the
    pretraining proof's), 16 steps with synchronous saves every 4, killed (SIGKILL) after step 9
    and resumed from 8 in a fresh process against the chain's uninterrupted DPO run: per-step
    metrics and the whole final state bitwise. Its resumed process shares the warm compile cache:
    the cold resume is tests/test_sft.py's full-SFT proof."""
    c = preference_chain / "posttrain" / "chain"
    v = json.loads((c / "dpo-resume" / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["curves_identical"] and v["final_state_identical"]
    assert v["steps_compared"] == 16 and v["kill_step"] == 9 and v["resumed_from_step"] == 8
    assert v["reference_dir"] == str(c / "dpo") and v["signal"] == "SIGKILL"
    assert v["final_state_compared"].startswith("step, parameters, optimizer state")
    summary = json.loads((c / "dpo" / "summary.json").read_text())
    assert load_model(c / "dpo").config.objective.kind == "dpo" and summary["final_step"] == 16


LORA_ONLINE = (
    "objective.lora.rank=4",
    "objective.dpo.reference_logprobs=online",
    "train.steps=12",
    "checkpoint.save_every=3",
)


@pytest.fixture(scope="module")
def lora_online_reference(sft_policy, sampled_pairs, tmp_path_factory):
    """The chaos run's uninterrupted reference (the same config), trained once in-process."""
    run = tmp_path_factory.mktemp("dpo-lora-online") / "run"
    train(tiny_config(*dpo_sets(sft_policy, sampled_pairs, *LORA_ONLINE)), run, progress=False)
    return run


@pytest.mark.slow
def test_dpo_lora_online_chaos_ends_identical(
    sft_policy, sampled_pairs, lora_online_reference, tmp_path
):
    """A short chaos run (`tpulab chaos`'s driver, called here; one random SIGKILL: the proof
    above covers the fixed kill point) on LoRA DPO with the reference online, against
    ``lora_online_reference``."""
    cfg = tiny_config(*dpo_sets(sft_policy, sampled_pairs, *LORA_ONLINE))
    one_kill_chaos(cfg, tmp_path, lora_online_reference, seed=1)
