"""PPO on CartPole (``objective.kind: ppo_env``) on the one loop: the truncation rule, cleanrl's
lr annealing, a train, a bitwise kill/resume proof with its negative control, chaos, refused
resumes and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, run_cli
from tpulab.train.objectives.rl_ppo import gae, td_targets

CONFIG = REPO / "configs" / "cartpole.yaml"
# tiny: 4 envs x 16 steps, 2 PPO updates per loop step, 16 loop steps = 2,048 env steps; the lr
# anneals over the run's 16 x 2 x 4 x 4 = 512 optimizer steps
TINY = (
    "train.steps=16",
    "optim.schedule_steps=512",
    "objective.ppo_env.num_steps=16",
    "objective.ppo_env.updates_per_step=2",
    "train.log_every=1",
    "train.eval_every=8",
    "checkpoint.save_every=4",
)


def _args(*sets: str) -> list[str]:
    return ["--config", str(CONFIG), *(x for s in (*TINY, *sets) for x in ("--set", s))]


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --- the truncation rule ------------------------------------------------------------------------


def _episode_data():
    rng = np.random.default_rng(0)
    t, n = 12, 3
    reward = jnp.asarray(rng.uniform(0, 1, (t, n)), jnp.float32)
    value = jnp.asarray(rng.normal(size=(t, n)), jnp.float32)
    final_value = jnp.asarray(rng.normal(size=(t, n)) + 5.0, jnp.float32)  # never 0
    term = np.zeros((t, n), bool)
    trunc = np.zeros((t, n), bool)
    term[3, 0] = term[9, 1] = True
    trunc[5, 0] = trunc[2, 2] = trunc[10, 2] = True
    return reward, value, final_value, jnp.asarray(term), jnp.asarray(trunc)


def test_truncated_transitions_bootstrap_from_final_obs_and_only_they_differ():
    reward, value, final_value, term, trunc = _episode_data()
    ours = td_targets(reward, final_value, term, 0.99)
    # control: the terminated-as-death version (every episode end is a death)
    death = td_targets(reward, final_value, term | trunc, 0.99)
    differs = np.asarray(ours != death)
    assert (differs == np.asarray(trunc)).all() and differs.sum() == 3
    assert np.allclose(np.asarray(ours - death)[np.asarray(trunc)], 0.99 * final_value[trunc])
    # GAE: the same rule; the returns differ from the death version at a truncation and at the
    # steps of its episode before it (in this rollout), and nowhere else
    _, ret = gae(reward, value, final_value, term, trunc, 0.99, 0.95)
    cont = ~(term | trunc)
    adv_d = np.zeros(value.shape, np.float32)
    nxt = np.zeros(value.shape[1], np.float32)
    delta = np.asarray(death - value)
    for i in reversed(range(value.shape[0])):
        nxt = delta[i] + 0.99 * 0.95 * np.asarray(cont[i]) * nxt
        adv_d[i] = nxt
    ret_death = adv_d + np.asarray(value)
    expected = np.zeros(value.shape, bool)
    expected[4:6, 0] = True  # env 0: terminated at 3 (steps 0..3 equal), truncated at 5
    expected[0:3, 2] = expected[3:11, 2] = True  # env 2: truncated at 2 and at 10
    got = ~np.isclose(np.asarray(ret), ret_death, rtol=0, atol=1e-4)
    assert (got == expected).all(), np.argwhere(got != expected)


# --- the CLI: train, prove-resume, refused resume, bad input -----------------------------------


@pytest.fixture(scope="module")
def proof(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ppo_env")
    # killed at 14: a save is committed before the next begins, so step 8's is whole (step 12's
    # may be cut short by the kill, as the proof means it to be)
    argv = ["prove-resume", *_args(), "--kill-at", "14", "--run-dir", str(d / "proof")]
    out = run_cli(*argv, "--no-track", timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return d / "proof"


@pytest.mark.slow
def test_ppo_env_resume_is_bitwise_on_metrics_and_the_whole_state(proof):
    v = json.loads((proof / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"] and v["data_position_files"] == 0
    for leaf in ("env_state (x", "obs", "ep_return", "updates", "optimizer state", "RNG key"):
        assert leaf in v["final_state_compared"], v["final_state_compared"]
    records = [json.loads(x) for x in (proof / "proof" / "reference" / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    assert len(train) == 16 and train[-1]["env_steps"] == 16 * 2 * 4 * 16
    for key in ("approx_kl", "clip_frac", "entropy", "episode_return", "truncated", "grad_norm"):
        assert all(np.isfinite(r[key]) for r in train), key
    assert sum(r["episodes_finished"] for r in train) > 0


@pytest.mark.slow
def test_ppo_env_resume_without_the_key_fails_the_verdict(proof, tmp_path):
    bad = tmp_path / "bad"
    out = run_cli(
        "prove-resume",
        *_args(),
        "--run-dir",
        str(bad),
        "--reference",
        str(proof / "proof" / "reference"),
        "--kill-at",
        "14",
        "--skip-restore",
        "rng",
        "--no-track",
        timeout=900,
    )
    assert out.returncode != 0
    v = json.loads((bad / "proof" / "verdict.json").read_text())
    assert not v["identical"] and not v["final_state_identical"] and v["skip_restore"] == ["rng"]
    # the key drives every rollout: the curves part on the first step after the resume, and the
    # params (first in tree order) differ, not only the key
    assert v["first_differing_step"] == v["resumed_from_step"] + 1
    assert v["first_differing_step_before_kill"] is None and "params" in v["first_differing_leaf"]


@pytest.mark.slow
def test_a_resume_with_other_total_steps_is_refused_and_changes_nothing(proof):
    """train.steps may change on resume for other objectives; PPO's lr schedule is sized by it."""
    run = proof / "proof" / "reference"
    before = _tree(run)
    out = run_cli(
        "train",
        *_args("train.steps=20", "optim.schedule_steps=640"),
        "--run-dir",
        str(run),
        "--no-track",
    )
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "train.steps: 16 -> 20 (objective.kind=ppo_env)" in out.stderr, out.stderr
    assert _tree(run) == before


@pytest.mark.slow
def test_ppo_env_survives_chaos(proof, tmp_path):
    """`tpulab chaos` on the RL config: SIGKILLs at random moments (start-up, a chunk, a save in
    flight), a fresh process resuming each time; every logged step and the whole final state
    (environments, key, episode accumulators) equal the uninterrupted run's, bitwise."""
    out = run_cli(
        "chaos",
        *_args(),
        "--run-dir",
        str(tmp_path / "chaos"),
        "--kills",
        "2",
        "--seed",
        "3",
        "--reference",
        str(proof / "proof" / "reference"),
        "--no-track",
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    v = json.loads((tmp_path / "chaos" / "chaos" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"] and v["kills"] == 2, v
    assert "env_state (x" in v["final_state_compared"], v["final_state_compared"]


@pytest.mark.slow
def test_a_resume_with_another_num_envs_is_refused_and_changes_nothing(proof):
    run = proof / "proof" / "reference"
    before = _tree(run)
    args = _args("objective.ppo_env.num_envs=8")
    out = run_cli("train", *args, "--run-dir", str(run), "--no-track")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _tree(run) == before
    # --force passes the config check; the state's shapes still refuse it, in one line
    out = run_cli("train", *args, "--run-dir", str(run), "--force", "--no-track")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "env_state" in out.stderr and "(4,)" in out.stderr and "(8,)" in out.stderr
    assert _tree(run) == before


@pytest.mark.parametrize(
    "sets, why",
    [
        (["objective.ppo_env.env=nope"], "unknown environment 'nope'; registered: cartpole"),
        (["objective.ppo_env.minibatches=5"], "minibatches=5 does not divide"),
        (["objective.ppo_env.ent_coef=nan"], "ppo_env.ent_coef' must be a finite number"),
        (["objective.ppo_env.vf_coef=inf"], "ppo_env.vf_coef' must be a finite number"),
        (["objective.ppo_env.num_envs=0"], "num_envs=0 must be a positive integer"),
        (["objective.ppo_env.seeds=0"], "seeds=0 must be a positive integer"),
        (["optim.schedule_steps=500"], "optim.schedule_steps=500 must be the run's optimizer"),
        (["optim.decay=step"], "optim.decay"),
    ],
)
def test_bad_ppo_env_settings_are_one_line_and_write_nothing(tmp_path, sets, why):
    run = tmp_path / "run"
    out = run_cli("train", *_args(*sets), "--run-dir", str(run), "--no-track")
    assert out.returncode != 0 and why in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not run.exists()


def test_lr_anneals_linearly_to_zero_as_cleanrl_does():
    """configs/cartpole.yaml's schedule: update u (1-based, of 980) runs all its 16 minibatch steps
    at cleanrl's ``lr * (1 - (u - 1) / 980)``; control: the platform's cosine does not."""
    import dataclasses

    from tpulab import load_config
    from tpulab.train.step import lr_schedule

    optim = load_config(CONFIG, []).optim
    sched = lr_schedule(optim)
    for u in (1, 2, 245, 490, 979, 980):
        cleanrl = 2.5e-4 * (1.0 - (u - 1.0) / 980)
        for j in (0, 7, 15):
            # float32: the schedule is exact to about 1e-7 of lr
            assert np.isclose(float(sched(16 * (u - 1) + j)), cleanrl, rtol=1e-5, atol=1e-10), u
    assert float(sched(15680)) == 0.0
    cosine = lr_schedule(dataclasses.replace(optim, decay="cosine", decay_every=1))
    assert abs(float(cosine(16 * 245)) - 2.5e-4 * 0.75) > 1e-5  # cosine: 0.854 lr, linear 0.75


def test_actor_critic_init_is_orthogonal_with_zero_biases():
    from flax import nnx

    from tpulab.train.objectives.rl_ppo import ActorCritic

    net = ActorCritic(4, 2, 64, rngs=nnx.Rngs(0))
    gains = {"a1": 2.0, "a2": 2.0, "a3": 0.01**2, "c1": 2.0, "c2": 2.0, "c3": 1.0}
    for name, g2 in gains.items():
        layer = getattr(net, name)
        w = np.asarray(layer.kernel.value)
        small = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T  # the orthonormal side
        assert np.allclose(small, g2 * np.eye(small.shape[0]), atol=1e-5 * max(g2, 1)), name
        assert not np.asarray(layer.bias.value).any(), name
    # control: flax's default (lecun normal) kernel is not orthogonal
    w = np.asarray(nnx.Linear(64, 64, rngs=nnx.Rngs(0)).kernel.value)
    assert not np.allclose(w.T @ w, np.eye(64) * np.trace(w.T @ w) / 64, atol=1e-2)


def _returns(run: Path) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    return [r["episode_return"] for r in records if "episode_return" in r]


@pytest.mark.slow
def test_cartpole_learns_and_flipped_advantages_do_not(tmp_path):
    """configs/cartpole.yaml for 30 loop steps (61,440 env steps): the normal run's return climbs
    (to 500, the cap, by 165k env steps in the full run); the control, the same run with the
    advantages' sign flipped (tests/rl_variants.py), learns to fall."""
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    config["objective"] = {
        "kind": "rl_variants:FlippedPPO",
        "flipped_ppo": config["objective"]["ppo_env"],
    }
    flipped_config = tmp_path / "flipped.yaml"
    flipped_config.write_text(yaml.safe_dump(config))
    paths = (str(REPO / "tests"), os.environ.get("PYTHONPATH"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    sets = ("--set", "train.steps=30", "--set", "optim.schedule_steps=1920", "--no-track")
    sets += ("--no-progress",)
    runs = {"normal": ["--config", str(CONFIG)], "flipped": ["--config", str(flipped_config)]}
    last = {}
    for name, config_args in runs.items():
        run = tmp_path / name
        out = run_cli("train", *config_args, *sets, "--run-dir", str(run), env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        last[name] = float(np.mean(_returns(run)[-5:]))
    assert last["normal"] > 150 and last["flipped"] < 30, last
