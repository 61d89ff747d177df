"""Digits: the CNN reference (``digits_cnn``), MAE pretraining (``digits_mae``) and the linear
probe (``tpulab probe``), at tiny sizes: the recorded partition, every MAE audit and its negative
control, the CNN's step-1 audit, bitwise kill/resume of both, the probe table and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli
from tpulab.config import load
from tpulab.data import digits
from tpulab.errors import TpulabError
from tpulab.train.config import RunConfig

MAE_CONFIG, CNN_CONFIG = REPO / "configs" / "digits_mae.yaml", REPO / "configs" / "digits_cnn.yaml"
TINY_RUN = (
    "data.batch_size=16",
    "train.steps=12",
    "train.log_every=1",
    "train.eval_every=6",
    "train.eval_batches=2",
    "checkpoint.save_every=4",
    "optim.warmup_steps=2",
    "optim.schedule_steps=12",
    "optim.lr=1e-2",
)
TINY_MAE = (*TINY_RUN, "model.d_model=16", "model.n_heads=2", "model.n_layers=1")
TINY_MAE += ("model.decoder_d_model=16", "model.decoder_heads=2")
TINY_CNN = (*TINY_RUN, "model.channels=4", "model.hidden=16")


def _sets(*sets: str) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def _config(path: Path, *sets: str) -> RunConfig:
    return load(RunConfig, path, list(sets))


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# --- the data source ----------------------------------------------------------------------------


def test_the_partition_is_seeded_disjoint_and_named_by_its_digest():
    cfg = _config(MAE_CONFIG).data
    a, b = digits.partition(cfg), digits.partition(cfg)
    assert a.identity == b.identity and (a.train == b.train).all()
    assert len(a.train) == 1437 and len(a.eval) == 360
    assert not set(a.train) & set(a.eval) and len(set(a.train) | set(a.eval)) == 1797
    other = digits.partition(_config(MAE_CONFIG, "data.split_seed=1").data)
    assert other.identity != a.identity and set(other.eval) != set(a.eval)  # control
    ids = digits.row_ids(digits.batch_of(a.train[:3]))
    assert [i.split(":")[0] for i in ids] == [str(i) for i in a.train[:3]]
    assert len(set(digits.image_ids(np.arange(1797)))) == 1797  # one identity per image
    first, streamed = digits.first_batch(a, cfg), next(digits.train_stream(a, cfg, 0, 1))
    assert all((first[k] == streamed[k]).all() for k in ("x", "y", "index"))


# --- the CLI: kill/resume of both, the run's records, the probe ---------------------------------


@pytest.fixture(scope="module")
def proofs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("digits")
    out = {}
    for name, config, sets in (("mae", MAE_CONFIG, TINY_MAE), ("cnn", CNN_CONFIG, TINY_CNN)):
        argv = ["prove-resume", "--config", str(config), *_sets(*sets), "--kill-at", "10"]
        argv += ["--warm-resume-cache"]  # the resumed child reads the others' compiled steps
        res = run_cli(*argv, "--run-dir", str(d / name), "--no-track", timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        out[name] = d / name
    return out


@pytest.mark.parametrize("name", ["mae", "cnn"])
def test_resume_is_bitwise_and_the_run_records_its_audits_and_partition(proofs, name):
    v = json.loads((proofs[name] / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["final_state_identical"], v
    ref = proofs[name] / "proof" / "reference"
    audits = json.loads((ref / "audits.json").read_text())
    assert audits and all(a["passed"] for a in audits.values()), audits
    records = _records(ref)
    first = next(r for r in records if "loss" in r)
    assert first["step"] == 1 and first["loss"] == pytest.approx(
        audits["step1_loss"]["loss"], rel=1e-6
    )  # the logged step-1 loss is the audited one, computed before the first update
    assert any(r.get("event") == "audits" for r in records)
    if name == "mae":
        assert all(r["masked_patches"] == 12 * 16 for r in records if "loss" in r)
    else:
        assert audits["step1_loss"]["expected"] == pytest.approx(math.log(10))
    env = json.loads((ref / "env.json").read_text())
    part = digits.partition(_config(MAE_CONFIG).data)
    assert env["identities"]["digits_partition"] == part.identity


def test_a_resume_on_another_partition_is_refused(proofs):
    from tpulab.checkpoint.store import read_meta, scan
    from tpulab.train.objectives.digits_mae import DigitsMAE
    from tpulab.train.resume_checks import check_resume_identity

    ckpts = proofs["mae"] / "proof" / "reference" / "checkpoints"
    meta = read_meta(ckpts / str(scan(ckpts).latest))
    for seed, refused in ((0, False), (1, True)):
        config = _config(MAE_CONFIG, *TINY_MAE, f"data.split_seed={seed}")
        objective = DigitsMAE(config)
        args = (meta, config, objective.data().identity, False, objective.identities(), None)
        if not refused:
            assert check_resume_identity(*args) == []
            continue
        with pytest.raises(TpulabError, match="digits_partition|corpus identity"):
            check_resume_identity(*args)


def test_the_probe_reads_the_encoder_against_the_cnn_and_the_pixels(proofs, tmp_path):
    out = tmp_path / "probe"
    encoder = proofs["mae"] / "proof" / "reference"
    argv = ["probe", "--encoder", str(encoder), "--seeds", "2", "--epochs", "2", "--out", str(out)]
    res = run_cli(*argv, *_sets(*TINY_CNN, "train.steps=4", "checkpoint.save_every=4"))
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads((out / "probe.json").read_text())
    assert set(record["models"]) == {"mae_linear_probe", "pixels_logistic_regression", "cnn"}
    for m in record["models"].values():
        lo, hi = m["interval_95"]
        assert len(m["accuracies"]) == 2 and lo <= m["accuracy_mean"] <= hi
        assert all(0.0 <= a <= 1.0 for a in m["accuracies"])
    assert record["held_out_images"] == 360 and record["encoder"]["feature_dim"] == 16
    assert all(Path(r, "summary.json").is_file() for r in record["models"]["cnn"]["runs"])
    # bad input: refused before anything is written (the CLI prints it as one line, exit 2)
    from tpulab.errors import ConfigError
    from tpulab.posttrain.probe import ProbeConfig, run_probe

    with pytest.raises(ConfigError, match="--seeds=1 must be in"):
        ProbeConfig(seeds=1)
    bad, cnn = tmp_path / "bad", _config(CNN_CONFIG, *TINY_CNN)
    not_an_encoder = proofs["cnn"] / "proof" / "reference"
    with pytest.raises(TpulabError, match="digits_cnn run: its model has no encoder to probe"):
        run_probe(not_an_encoder, bad, cnn, ProbeConfig(seeds=2))
    with pytest.raises(TpulabError, match="not objective.kind=digits_mae"):
        run_probe(encoder, bad, _config(MAE_CONFIG), ProbeConfig(seeds=2))
    with pytest.raises(TpulabError, match="already exists and is not empty"):
        run_probe(encoder, out, cnn, ProbeConfig(seeds=2))
    assert not bad.exists()


# --- the MAE's audits and their negative controls (in-process, tiny) -----------------------------


def _objective(cls_path: str, *sets: str):
    import importlib

    from tpulab.train.step import make_mesh

    module, _, name = cls_path.partition(":")
    config = _config(MAE_CONFIG, *TINY_MAE, *sets)
    objective = getattr(importlib.import_module(module), name)(config)
    return objective, objective.steps(make_mesh(config))


def _audits(cls_path: str):
    objective, steps = _objective(cls_path)
    return objective.audits(steps, steps.init())


def test_the_mae_audits_pass_and_count_exactly():
    audits = _audits("tpulab.train.objectives.digits_mae:DigitsMAE")
    assert all(a["passed"] for a in audits.values()), audits
    assert audits["masked_count"]["masked_patches"] == math.floor(0.75 * 16) * 16 == 192
    assert audits["loss_reads_masked_patches_only"]["visible_patches_in_loss"] == 0
    assert audits["masked_pixels_never_reach_the_model"]["visible_patches_reaching_the_model"] > 0
    assert audits["step1_loss"]["relative_error"] < 1e-5


def test_an_inverted_mask_polarity_is_caught():
    audits = _audits("vision_controls:InvertedMask")
    assert not audits["loss_reads_masked_patches_only"]["passed"]
    assert audits["loss_reads_masked_patches_only"]["visible_patches_in_loss"] == 4 * 16
    assert not audits["masked_count"]["passed"] and audits["masked_count"]["masked_patches"] == 64
    assert audits["masked_pixels_never_reach_the_model"]["passed"]  # that path is still clean
    assert not audits["step1_loss"]["passed"]  # scored on other patches than the closed form's


def test_the_cnn_step1_audit_is_ln10_and_fails_on_a_head_that_is_not_zero():
    import jax

    from tpulab.train.objectives.digits_cnn import DigitsCNN
    from tpulab.train.step import make_mesh

    config = _config(CNN_CONFIG, *TINY_CNN)
    objective = DigitsCNN(config)
    steps = objective.steps(make_mesh(config))
    state = steps.init()
    good = objective.audits(steps, state)["step1_loss"]
    assert good["passed"] and good["expected"] == pytest.approx(math.log(10), rel=1e-12)
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
    bad = state._replace(params=jax.tree.unflatten(tree, noisy))  # (a constant shift keeps ln 10)
    assert not objective.audits(steps, bad)["step1_loss"]["passed"]  # negative control


def _losses(cls_path: str, steps_n: int) -> list[float]:
    """The loss of ``steps_n`` train steps driven directly (outside the loop and its audits)."""
    objective, steps = _objective(cls_path)  # the proofs' config: their compiled step, cached
    stream, state, out = objective.data().train(0, 1), steps.init(), []
    for _ in range(steps_n):
        state, metrics = steps.train(state, steps.put_batch(next(stream)))
        out.append(float(metrics["loss"]))
    return out


def test_a_decoder_handed_the_masked_pixels_is_flagged_and_its_loss_collapses(proofs, tmp_path):
    from tpulab.train.loop import train
    from vision_controls import LeakyDecoder

    # the loop refuses to train on it: the audits are written, no step is taken
    config, run = _config(MAE_CONFIG, *TINY_MAE), tmp_path / "leaky"
    with pytest.raises(TpulabError, match="audit masked_pixels_never_reach_the_model failed"):
        train(config, run, progress=False, objective=LeakyDecoder(config))
    audits = json.loads((run / "audits.json").read_text())
    flagged = audits["masked_pixels_never_reach_the_model"]
    assert not flagged["passed"] and flagged["masked_patches_reaching_the_model"] == 12 * 16
    assert audits["loss_reads_masked_patches_only"]["passed"] and audits["step1_loss"]["passed"]
    assert not any("loss" in r for r in _records(run)) and not list(run.glob("checkpoints/*/"))
    # driven anyway, its loss collapses far below the honest model's in the same steps
    honest = [r["loss"] for r in _records(proofs["mae"] / "proof" / "reference") if "loss" in r]
    leaky = _losses("vision_controls:LeakyDecoder", len(honest))
    assert leaky[0] == pytest.approx(honest[0], rel=1e-6)  # the zero head: the same closed form
    assert np.mean(leaky[-4:]) < 0.5 * np.mean(honest[-4:]), (honest, leaky)  # about 0.3 here


def test_the_probe_interval_is_students_t():
    from tpulab.posttrain.probe import interval

    got = interval([0.9, 0.92, 0.94])
    half = 4.302652729911275 * 0.02 / math.sqrt(3)  # t(0.975, 2)
    assert got["interval_95"] == pytest.approx([0.92 - half, 0.92 + half])
    assert interval([0.5, 0.5])["interval_95"] == [0.5, 0.5]


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, says",
    [
        (["objective.digits_mae.mask_ratio=1.0"], "mask_ratio=1.0 must be in (0, 1)"),
        (["model.patch=3"], "model.patch=3 does not divide model.image_size=8"),
    ],
)
def test_bad_mae_input_is_one_line_and_writes_nothing(tmp_path, sets, says):
    run = tmp_path / "run"
    res = run_cli("train", "--config", str(MAE_CONFIG), *_sets(*sets), "--run-dir", str(run))
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert says in res.stderr and not run.exists()


@pytest.mark.parametrize(
    "sets, says",
    [
        (["objective.digits_mae.mask_ratio=0.0"], "must be in (0, 1)"),
        (["objective.digits_mae.mask_ratio=0.05"], "masks 0 of 16 patches"),
        (["model.patch=8"], "leaves one patch"),
        (["model.image_size=16"], "model.image_size=16 must be 8"),
    ],
)
def test_more_bad_mae_configs_are_refused(sets, says):
    with pytest.raises(TpulabError, match=None) as e:
        _config(MAE_CONFIG, *sets)
    assert says in str(e.value)
