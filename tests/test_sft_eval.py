"""SFT evaluation (tpulab.posttrain): response loss, stop position, stop rate, merged generations.

A model that has learnt to stop is the positive control of the stop measurements: a tiny SFT run
on a JSONL set of four short exchanges (held-out: the last four lines) learns to answer and emit
ETX within 60 steps, while the pretrained base, which never saw ETX, never does. Sizes are the
tiny test config's; the base is the session's ``trained_run``.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import tiny_config
from tpulab.data import dialogue as D
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.posttrain import evaluate, evaluate_sft, log_to_run
from tpulab.train.loop import train
from tpulab.train.merge import merge_lora

QA = [
    ("A.\nGo.\n\nB.\n", "Ay."),
    ("C.\nCome.\n\nD.\n", "No."),
    ("E.\nSay.\n\nF.\n", "Well."),
    ("G.\nWho?\n\nH.\n", "I."),
]


def qa_config(base, data, steps: int, *extra: str):
    return tiny_config(
        "objective.kind=sft",
        f"objective.init={base}",
        f"objective.data={data}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"checkpoint.save_every={steps}",
        f"optim.schedule_steps={steps}",
        f"optim.warmup_steps={min(5, steps - 1)}",
        *extra,
    )


@pytest.fixture(scope="module")
def qa_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    lines = [json.dumps({"prompt": p, "response": r}) for _ in range(10) for p, r in QA]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def qa_run(trained_run, qa_data, tmp_path_factory):
    """Full SFT on the exchanges, tracked in an MLflow store beside it."""
    from tpulab.tracking.hook import MlflowTracker
    from tpulab.tracking.store import sqlite_uri

    root = tmp_path_factory.mktemp("qa-run")
    run = root / "run"
    tracker = MlflowTracker(run, sqlite_uri(root / "mlruns.db"))
    try:
        train(
            qa_config(trained_run, qa_data, 60, "optim.lr=1e-2"),
            run,
            hooks=[tracker],
            progress=False,
        )
    finally:
        tracker.close()
    return run


@pytest.fixture(scope="module")
def qa_eval(qa_run):
    return evaluate_sft(qa_run)


def test_the_stop_rate_is_measured_on_a_model_that_stops_and_the_base_that_cannot(qa_eval):
    stop, base, sft = qa_eval["stop"], qa_eval["models"]["base"], qa_eval["models"]["sft"]
    assert stop["max_new"] == 8 and stop["room"] == 16  # a quarter of the 32 positions, twice
    assert stop["prompts"] == 4 and stop["skipped_prompts"] == 0 and stop["reference_rate"] == 1.0
    # the base never saw ETX: it neither predicts it at the stop nor emits it
    assert base["stop_rate"] == 0.0 and base["stop_rate_in_room"] == 0.0
    assert base["stop_accuracy"] == 0.0 and base["stop_probability"] < 0.01
    assert sft["stop_rate"] == 1.0 and sft["stop_accuracy"] >= 0.75
    for s in qa_eval["samples"]:
        assert s["base_stop_bytes"] is None and s["sft_stop_bytes"] <= stop["max_new"]


def test_the_losses_are_the_objectives_and_tell_the_models_apart(qa_run, qa_eval):
    base, sft = qa_eval["models"]["base"], qa_eval["models"]["sft"]
    logged = [r for r in read_records(qa_run) if r.get("event") == "eval"][-1]["val_loss"]
    assert sft["val_loss"] == logged  # the objective's eval step: the run's own number, bitwise
    # the explicit response loss agrees with the objective's eval step on the same four pairs
    assert qa_eval["dataset"]["loss_pairs"] == qa_eval["dataset"]["val_pairs"] == 4
    for m in (base, sft):
        assert abs(m["response_loss"] - m["val_loss"]) <= 1e-6 * m["val_loss"]
    # control: the measurement separates a model that learnt the answers from one that did not
    assert base["response_loss"] > 2 * sft["response_loss"]


def test_prompts_leave_the_room_by_cutting_the_cue_from_the_left():
    long = D.Pair(b"KING.\n" + b"word " * 10 + b"\n\nHAM.\n", b"Ay.", "x")
    short = D.Pair(b"A.\nGo.\n\nB.\n", b"Ay.", "y")
    chosen, skipped = evaluate.stop_prompts([long, short], 32, 8, 2, cut=True)
    assert skipped == 0 and all(len(p.ids) + 8 <= 32 for p in chosen)
    cut = bytes(chosen[0].ids[2:-1].astype(np.uint8))
    assert cut.startswith(b"KING.\n") and cut.endswith(b"word \n\nHAM.\n") and len(cut) < 60
    assert chosen[0].ids[0] == 256 and chosen[0].ids[1] == D.PROMPT_START
    assert chosen[0].ids[-1] == D.RESPONSE_START
    # control: a JSONL prompt is never cut, so the long one is left out
    chosen, skipped = evaluate.stop_prompts([long, short], 32, 8, 2, cut=False)
    assert skipped == 1 and [p.pair for p in chosen] == [short]


def test_a_merged_lora_model_is_measured_and_generates_what_the_adapters_do(
    trained_run, qa_data, tmp_path
):
    import jax

    from tpulab.model import lora
    from tpulab.train.merge import folded
    from tpulab.train.restore import load_model
    from tpulab.train.step import tree_digest

    run, merged = tmp_path / "lora", tmp_path / "merged"
    train(qa_config(trained_run, qa_data, 12, "objective.lora.rank=4"), run, progress=False)
    # merge-lora's jitted fold is bitwise the eager W + (alpha / r) A B (control: not the base's)
    adapted = load_model(run)
    eager = jax.device_get(lora.merged_params(adapted.model))
    assert tree_digest(folded(adapted.model)) == tree_digest(eager)
    assert tree_digest(eager) != tree_digest(adapted.base.state.params)
    merge_lora(run, merged)
    r = evaluate_sft(run, merged=merged, with_base=False)
    assert set(r["models"]) == {"sft", "merged"}
    m = r["merged"]
    assert m["generations"] == 4 and m["identical_generations"] == 4
    a, b = r["models"]["sft"]["response_loss"], r["models"]["merged"]["response_loss"]
    assert abs(a - b) <= 1e-5 * a
    # negative control: a merged model that names another source checkpoint is refused
    record = json.loads((merged / "merge.json").read_text())
    (merged / "merge.json").write_text(json.dumps({**record, "source_checkpoint_digest": "0" * 64}))
    with pytest.raises(TpulabError, match="was merged from checkpoint 000000000000"):
        evaluate_sft(run, merged=merged)


def test_a_moved_base_or_a_pretraining_run_is_refused(trained_run, qa_data, tmp_path):
    with pytest.raises(TpulabError, match="is a pretrain run, not sft"):
        evaluate_sft(trained_run)
    base = tmp_path / "base"
    shutil.copytree(trained_run, base)
    run = tmp_path / "sft"
    train(qa_config(base, qa_data, 2), run, progress=False)
    assert evaluate_sft(run, prompts=1)["models"]["base"]["stop_rate"] == 0.0  # control
    train(tiny_config("train.steps=50"), base, progress=False)  # objective.init moves on
    with pytest.raises(TpulabError, match="was trained on base .*refusing to compare"):
        evaluate_sft(run)


def test_the_evaluation_is_logged_to_the_runs_mlflow_run(qa_run, qa_eval, tmp_path, capsys):
    from tpulab.tracking.store import open_store, read_run_link

    path = tmp_path / "eval.json"
    path.write_text(json.dumps(qa_eval))
    assert log_to_run(qa_run, qa_eval, [path])
    link = read_run_link(qa_run)
    client, _ = open_store(link["tracking_uri"])
    for key, value in evaluate.metrics_of(qa_eval).items():
        history = client.get_metric_history(link["run_id"], key)
        assert [(h.step, h.value) for h in history] == [(60, value)], key
    assert "eval.sft.stop_rate" in evaluate.metrics_of(qa_eval)
    assert [a.path for a in client.list_artifacts(link["run_id"], "posttrain")] == [
        "posttrain/eval.json"
    ]
    # negative control: a run dir with no MLflow run is one warning line, not a silent success
    lone = tmp_path / "lone"
    lone.mkdir()
    assert not log_to_run(lone, qa_eval)
    assert "has no MLflow run" in capsys.readouterr().err


def test_sft_eval_cli_writes_the_record_and_refuses_bad_input_in_one_line(
    qa_run, trained_run, tmp_path, capsys
):
    """`tpulab sft-eval` through the CLI's own ``main`` in this process (a TpulabError's exit
    code and its one line in a real process are tests/test_cli_errors.py's)."""
    from tpulab.cli.main import main

    out = tmp_path / "e.json"
    assert main(["sft-eval", "--run-dir", str(qa_run), "--out", str(out), "--prompts", "2"]) == 0
    ok = capsys.readouterr().out
    assert "held-out response loss" in ok and "over 2 prompts" in ok
    assert json.loads(out.read_text())["stop"]["prompts"] == 2
    code = main(["sft-eval", "--run-dir", str(trained_run), "--out", str(tmp_path / "x.json")])
    assert code != 0 and not (tmp_path / "x.json").exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error:") and "not sft" in lines[-1]


def test_the_capstone_has_a_skip_posttrain_flag():
    from tpulab.cli.main import build_parser
    from tpulab.orchestrate.capstone import CapstoneOptions

    args = build_parser().parse_args(["capstone", "--out", "x", "--skip-posttrain"])
    assert args.skip_posttrain and not CapstoneOptions().skip_posttrain
    assert not build_parser().parse_args(["capstone", "--out", "x"]).skip_posttrain


@pytest.mark.slow
def test_the_capstone_posttrain_stage_trains_tracks_merges_and_evaluates(
    trained_run, tmp_path, monkeypatch
):
    """The stage at the CI size: SFT and LoRA children from the pretrained run, each tracked;
    the evaluation in both MLflow runs; the section with its evidence."""
    from tpulab.orchestrate.capstone import posttrain_stage, tracking_section
    from tpulab.tracking.store import open_store, read_run_link, sqlite_uri

    uri = sqlite_uri(tmp_path / "mlruns.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    section = posttrain_stage(tiny_config(), trained_run, tmp_path)
    d = tmp_path / "posttrain"
    assert section.startswith("## Post-training") and (d / "posttrain.md").read_text() == section
    assert "| full SFT | " in section and "| LoRA r8 | " in section and "LoRA r8 merged" in section
    assert section.split("\n")[2].startswith("**A mechanics check, not a quality result.**")
    assert (d / "curves.png").stat().st_size > 10_000
    assert json.loads((d / "lora-merged" / "merge.json").read_text())["adapted_matrices"] == 8
    for name in ("sft", "lora"):
        record = json.loads((d / f"eval_{name}.json").read_text())
        assert (
            record["base"]["digest"]
            == json.loads((d / name / "summary.json").read_text())["identities"]["base"]
        )
        link = read_run_link(d / name)
        client, _ = open_store(uri)
        got = client.get_run(link["run_id"]).data.metrics
        assert got["eval.sft.response_loss"] == record["models"]["sft"]["response_loss"]
    # the capstone's own audit finds both runs complete in the store
    text, failures = tracking_section(tmp_path, uri)
    assert failures == [] and "**2 of 2** runs complete" in text


@pytest.mark.slow
@pytest.mark.timeout(
    1800
)  # 5 child processes and 3 in-process generations: 600 s ran out at load 24
def test_the_preference_chain_section_is_what_its_runs_recorded(
    preference_chain, trained_run, tmp_path
):
    """The capstone's preference-chain stage from an SFT run at the tiny size (``preference_chain``,
    shared with tests/test_dpo.py's DPO proof): the section's identity rows are the digests the
    checkpoints recorded and recompute from their sources, its verdict is the proof's verdict
    file, its gold-vs-proxy rows are PPO's evaluations in metrics.jsonl, every run is in the MLflow
    store; control: a changed SFT checkpoint shows as changed in every row that names it. A run
    that is not SFT is refused in one line."""
    from tpulab.checkpoint.files import MANIFEST, manifest_digest
    from tpulab.checkpoint.rundir import RunDir
    from tpulab.checkpoint.store import read_meta
    from tpulab.config import load
    from tpulab.orchestrate.chain import (
        DEMO,
        chain_configs,
        changed,
        identity_rows,
        run_chain,
    )
    from tpulab.tracking.audit import audit_runs, run_dirs
    from tpulab.tracking.store import sqlite_uri
    from tpulab.train.config import RunConfig
    from tpulab.train.restore import checkpoint_dir

    with pytest.raises(TpulabError, match="is a pretrain run, not sft"):
        run_chain(trained_run, tmp_path / "not-from-sft")
    assert not (tmp_path / "not-from-sft").exists()
    out, sft = preference_chain, preference_chain / "sft"
    uri = sqlite_uri(out / "mlruns.db")
    section = (out / "section.md").read_text()
    c = out / "posttrain" / "chain"
    assert (c / "chain.md").read_text() == section and section.startswith("## Preference chain")
    assert "**A mechanics check, not a quality result.**" in section
    assert "| default size (committed) |" in section and "0.754 (130 / 126 / 0 of 256)" in section
    record = json.loads((c / "chain.json").read_text())
    rows = record["identities"]
    assert len(rows) == 12 and all(r["unchanged"] for r in rows)
    for r in rows:
        recorded = read_meta(checkpoint_dir(c / r["run"] if r["run"] != "sft" else sft))
        assert r["recorded"] == recorded["identities"][r["name"]]
        if r["name"] in ("base", "init", "reference", "reward_model"):
            assert r["recomputed"] == manifest_digest(checkpoint_dir(r["source_dir"]))
        assert f"| {r['run']} | {r['name']} | `{r['recorded'][:16]}` |" in section
    assert "**12 of 12 unchanged**" in section
    v = json.loads((c / "dpo-resume" / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"] and v["steps_compared"] == 16
    assert f"after step {v['kill_step']}, resumed from step {v['resumed_from_step']}" in section
    assert "**bitwise identical**" in section
    evals = [r for r in read_records(c / "ppo") if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 6, 9, 12]
    for e in evals:
        assert f"| {e['step']} | {e['val_kl']:.4f} | {e['val_reward']:.4f} | " in section
    for name in ("reward", "dpo", "ppo"):
        assert (c / f"{name}-curves.png").stat().st_size > 10_000
        assert f"](posttrain/chain/{name}-curves.png)" in section
    w = record["win_rate"]["dpo"]
    assert f"| DPO vs SFT | {w['prompts']} | {w['win_rate']:.3f} |" in section
    # control: one byte more in the newest manifest of (a copy of) the SFT run is another
    # checkpoint; the rows recorded by the chain's runs are read from the chain's own dirs
    moved = tmp_path / "sft"
    shutil.copytree(sft, moved)
    manifest = checkpoint_dir(moved) / MANIFEST
    manifest.write_bytes(manifest.read_bytes() + b"\n")
    runs = {"sft": moved, "pairs": c / "pairs", **{k: c / k for k in ("reward", "dpo", "ppo")}}
    runs["dpo_resumed"] = c / "dpo-resume" / "proof" / "interrupted"
    sft_config = load(RunConfig, RunDir(moved).config)
    configs = chain_configs(sft_config, moved, runs["pairs"], runs["reward"], DEMO)
    after = identity_rows(runs, configs)
    moved_rows = {(r["run"], r["name"]) for r in after if not r["unchanged"]}
    assert moved_rows == {
        ("reward", "base"),
        ("dpo", "base"),
        ("dpo", "reference"),
        ("ppo", "init"),
        ("ppo", "reference"),
    }
    assert len(changed(after)) == 5 and "ppo's reference changed" in " ".join(changed(after))
    # the reward, DPO and PPO runs and the proof's killed-and-resumed run, each in the store whole
    tracked = audit_runs(run_dirs(c), uri)
    assert len(tracked) == 4 and [t.problem for t in tracked] == [None] * 4
