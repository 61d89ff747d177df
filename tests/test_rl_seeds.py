"""`tpulab seeds` on CartPole at a tiny size: N seeds vmapped in one run, each scored on held-out
episodes, the rliable aggregate in seeds.json and the report; a second config compared on the same
seeds; the key bug (every seed one key) failing the run; bad input refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli
from tpulab.evidence import intervals

CONFIG = REPO / "configs" / "cartpole.yaml"
PYTHONPATH = os.environ.get("PYTHONPATH")
# tiny: 4 envs x 16 steps, 2 PPO updates a loop step, 4 loop steps (512 env steps a seed)
TINY = (
    "train.steps=4",
    "optim.schedule_steps=128",
    "objective.ppo_env.num_steps=16",
    "objective.ppo_env.updates_per_step=2",
    "objective.ppo_env.eval_episodes=4",
    "train.eval_every=4",
    "checkpoint.save_every=2",
)


def _sets(*extra: str) -> list[str]:
    return [x for s in (*TINY, *extra) for x in ("--set", s)]


def _variant(tmp: Path, kind: str, section: str) -> Path:
    """configs/cartpole.yaml with its objective replaced by a tests/rl_variants.py class."""
    config = yaml.safe_load(CONFIG.read_text())
    config["objective"] = {"kind": kind, section: config["objective"]["ppo_env"]}
    path = tmp / f"{section}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("seeds")
    # the same config again as --compare: trained on the same seeds, it must score the same
    same = d / "same.yaml"
    same.write_text(CONFIG.read_text())
    out = run_cli(
        "seeds",
        "--config",
        str(CONFIG),
        "--seeds",
        "3",
        "--out",
        str(d / "out"),
        "--compare",
        str(same),
        *_sets(),
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 seeds (vmapped): IQM" in out.stdout, out.stdout
    return d / "out"


@pytest.mark.slow
def test_seeds_json_holds_the_rliable_aggregate(seeds_run):
    r = json.loads((seeds_run / "seeds.json").read_text())
    assert r["passed"] and r["curves_distinct"] and r["identical_pairs"] == []
    assert r["seeds"] == [0, 1, 2] and len(r["per_seed"]) == 3 and r["mode"] == "vmapped"
    assert r["iqm"] == pytest.approx(intervals.iqm(r["per_seed"]))
    assert r["mean"] == pytest.approx(np.mean(r["per_seed"]))
    assert r["ci_low"] <= r["iqm"] <= r["ci_high"]
    assert min(r["per_seed"]) <= r["ci_low"] and r["ci_high"] <= max(r["per_seed"])
    # 512 env steps a seed is far from 475: the median is "never", each seed's too
    assert r["steps_to_475"] is None and r["steps_to_475_per_seed"] == [None] * 3
    assert r["env_steps"] == 3 * 512 and r["env_steps_per_s"] > 0
    assert r["provenance"]["cpu"]["model_name"] and len(r["provenance"]["load_avg_before"]) == 3
    # the seeds differ: their held-out scores (greedy, 4 episodes each) are not all equal
    assert len(set(r["per_seed"])) > 1, r["per_seed"]
    # compared with itself on the same seeds: the same scores, P(improvement) exactly 1/2
    c = r["compare"]
    assert c["per_seed"] == r["per_seed"] and c["probability_of_improvement"] == 0.5
    assert c["poi_ci_low"] <= 0.5 <= c["poi_ci_high"]


@pytest.mark.slow
def test_the_vmapped_run_logs_each_seed_and_the_report_shows_them(seeds_run):
    records = [json.loads(x) for x in (seeds_run / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4 and steps[-1]["env_steps"] == 512  # per seed
    curves = [[r[f"episode_return.seed{i}"] for r in steps] for i in range(3)]
    assert curves[0] != curves[1] != curves[2]
    env = json.loads((seeds_run / "run" / "env.json").read_text())
    assert env["shapes"]["seeds"] == 3 and env["param_count"] == 3 * 9_155  # 3 actor-critics
    report = (seeds_run / "report.md").read_text()
    assert "## Seeds" in report and "IQM [95% CI]" in report and "plots/seeds.png" in report
    assert "Probability of improvement of `config` over `compare`: 0.50" in report
    assert (seeds_run / "plots" / "seeds.png").stat().st_size > 1000
    assert "Seeds" in (seeds_run / "report.html").read_text()


@pytest.mark.slow
def test_in_sequence_the_seeds_are_the_vmapped_lanes(seeds_run, tmp_path):
    """--sequence: one run a seed (seed + i). Lane i of the vmapped run is that seed: the same
    held-out score and episode returns; the losses equal to float32 rounding (vmap batches the
    reductions, so the last bits may differ)."""
    out = run_cli(
        "seeds",
        "--config",
        str(CONFIG),
        "--seeds",
        "2",
        "--sequence",
        "--out",
        str(tmp_path / "out"),
        *_sets(),
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads((tmp_path / "out" / "seeds.json").read_text())
    vmapped = json.loads((seeds_run / "seeds.json").read_text())
    assert r["mode"] == "sequence" and r["per_seed"] == vmapped["per_seed"][:2]
    lanes = [json.loads(x) for x in (seeds_run / "run" / "metrics.jsonl").open()]
    for i in range(2):
        own = [json.loads(x) for x in (tmp_path / "out" / f"seed{i}" / "metrics.jsonl").open()]
        own = [x for x in own if "loss" in x]
        lane = [x for x in lanes if "loss" in x]
        assert [x["episode_return"] for x in own] == [x[f"episode_return.seed{i}"] for x in lane]
        got, want = [x["loss"] for x in own], [x[f"loss.seed{i}"] for x in lane]
        assert np.allclose(got, want, rtol=1e-5, atol=0), (got, want)


@pytest.mark.slow
def test_identical_curves_across_seeds_fail_the_run(tmp_path):
    """Negative control: every lane given the run's one seed (tests/rl_variants.py) trains the
    same curves; the run fails in one line and says so in seeds.json."""
    config = _variant(tmp_path, "rl_variants:SharedKeyPPO", "shared_key_ppo")
    sets = [s.replace("ppo_env.", "shared_key_ppo.") for s in _sets()]
    out = run_cli(
        "seeds",
        "--config",
        str(config),
        "--seeds",
        "2",
        "--out",
        str(tmp_path / "out"),
        *sets,
        env={"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO / "tests"), PYTHONPATH)))},
        timeout=600,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "seeds 0 and 1 of config trained identical curves" in out.stderr, out.stderr
    r = json.loads((tmp_path / "out" / "seeds.json").read_text())
    assert not r["passed"] and r["identical_pairs"] == [[0, 1]]
    assert r["per_seed"][0] == r["per_seed"][1]


@pytest.mark.parametrize(
    "args, why",
    [
        (["--seeds", "0"], "--seeds '0' must be a positive integer"),
        (["--seeds", "-2"], "--seeds '-2' must be a positive integer"),
        (["--seeds", "2.5"], "--seeds '2.5' must be a positive integer"),
        (["--seeds", "x"], "--seeds 'x' must be a positive integer"),
        (["--seeds", "2", "--target", "nan"], "--target nan must be a finite number"),
        (
            ["--seeds", "2", "--set", "objective.ppo_env.minibatches=5"],
            "minibatches=5 does not divide",
        ),
        (
            ["--seeds", "2", "--set", "objective.ppo_env.clip_coef=inf"],
            "ppo_env.clip_coef' must be a finite number",
        ),
        (["--seeds", "2", "--set", "optim.schedule_steps=100"], "optim.schedule_steps=100 must"),
    ],
)
def test_bad_seeds_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, why):
    from tpulab.cli.main import main

    out = tmp_path / "out"
    code = main(["seeds", "--config", str(CONFIG), *_sets(), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_steps_to_target_is_the_first_crossing():
    from tpulab.orchestrate.seeds import Arm, _median

    curves = [
        {"env_steps": [1.0, 2.0, 3.0], "score": [10.0, 480.0, 400.0]},
        {"env_steps": [1.0, 2.0, 3.0], "score": [10.0, 20.0, 475.0]},
        {"env_steps": [1.0, 2.0, 3.0], "score": [10.0, 20.0, 30.0]},
    ]
    arm = Arm("a", [0, 1, 2], [1.0, 2.0, 3.0], curves, 1.0, 1.0)
    reach = arm.steps_to("env_steps", 475.0)
    assert reach == [2.0, 3.0, None]
    assert _median(reach) == 3.0  # the never-reaching seed counts as last
    assert _median([2.0, None, None]) is None
