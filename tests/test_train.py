import json
import shutil

import jax
import numpy as np
import pytest

from conftest import tiny_config
from tpulab.checkpoint.files import MANIFEST
from tpulab.checkpoint.store import CheckpointStore
from tpulab.compile_cache import count_compiles
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, train_dataset
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.train.loop import train
from tpulab.train.step import make_steps


def test_steady_state_never_recompiles():
    cfg = tiny_config()
    steps = make_steps(cfg)
    it = iter(train_dataset(build_splits(load_corpus(None), cfg.data).train_windows, cfg.data))
    state = steps.init()
    state, m = steps.train(state, steps.put_batch(next(it)))  # warm-up compile
    steps.eval(state.params, steps.put_batch(next(it)))
    jax.block_until_ready(m)
    with count_compiles() as compiles:
        for _ in range(8):
            state, m = steps.train(state, steps.put_batch(next(it)))
            steps.eval(state.params, steps.put_batch(next(it)))
        jax.block_until_ready(m)
    assert compiles["n"] == 0
    assert steps.train._cache_size() == 1


def test_compile_counter_sees_a_recompile():
    """The counter can fail: a new shape must register as a compile."""
    import jax.numpy as jnp

    f = jax.jit(lambda x: x * 2)
    f(jnp.ones(3))
    with count_compiles() as compiles:
        f(jnp.ones(4))
    assert compiles["n"] >= 1


def test_checkpoint_holds_the_full_state(trained_run):
    """Params, both Adam moments, count, step, dropout key and data position all come back
    exactly."""
    cfg = tiny_config()
    steps = make_steps(cfg)
    store = CheckpointStore(trained_run / "checkpoints", keep=3, async_save=False)
    try:
        assert store.latest == 40 and sorted(
            int(p.name) for p in store.directory.iterdir() if p.name.isdigit()
        ) == [20, 30, 40]
        windows = build_splits(load_corpus(None), cfg.data).train_windows
        it = iter(train_dataset(windows, cfg.data))
        state = store.restore(40, steps.abstract_state(), it)
    finally:
        store.close()
    assert int(state.step) == 40
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = (ScaleByAdamState, ...)
    assert int(adam.count) == 40
    assert all(float(jnp_abs_sum(x)) > 0 for x in (adam.mu, adam.nu, state.params))
    assert it.get_state()["next_index"] == 40
    manifest = json.loads((trained_run / "checkpoints" / "40" / MANIFEST).read_text())
    assert any(k.startswith("state/") for k in manifest["files"]) and any(
        k.startswith("data/") for k in manifest["files"]
    )
    # the dropout key is the one the uninterrupted run would use next, not the initial one
    assert not np.array_equal(np.asarray(state.rng), np.asarray(steps.init().rng))


def jnp_abs_sum(tree):
    return sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(tree))


def _copy_run(trained_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained_run, dst)
    return dst


def test_corrupt_newest_checkpoint_is_refused_kept_and_the_previous_used(
    trained_run, tmp_path, capfd
):
    run = _copy_run(trained_run, tmp_path)
    victim = next((run / "checkpoints" / "40" / "state").rglob("*.0*"), None) or max(
        (p for p in (run / "checkpoints" / "40" / "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    summary = train(tiny_config("train.steps=45"), run, progress=False)
    assert summary.resumed_from == 30
    assert "refusing checkpoint step 40" in capfd.readouterr().err
    rejected = list((run / "rejected_checkpoints").iterdir())
    assert len(rejected) == 1 and rejected[0].name.startswith("40-")  # kept, not deleted


def test_all_checkpoints_corrupt_is_an_error_when_none_left(trained_run, tmp_path):
    from tpulab.train.restore import load_model

    run = _copy_run(trained_run, tmp_path)
    for step_dir in (run / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            (step_dir / MANIFEST).write_text("{}")
    with pytest.raises(TpulabError, match="no valid checkpoint"):
        load_model(run)


@pytest.mark.parametrize(
    "override, what", [("optim.lr=0.01", "optim.lr"), ("model.dropout=0.0", "model.dropout")]
)
def test_resume_refuses_a_changed_config_unless_forced(trained_run, tmp_path, override, what):
    run = _copy_run(trained_run, tmp_path)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(TpulabError, match=f"different {what}.*--force"):
        train(tiny_config(override, "train.steps=42"), run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    summary = train(tiny_config(override, "train.steps=42"), run, force=True, progress=False)
    assert summary.resumed_from == 40 and summary.final_step == 42


def test_resume_refuses_a_changed_corpus(trained_run, tmp_path):
    run = _copy_run(trained_run, tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 400)
    with pytest.raises(TpulabError, match="corpus identity"):
        train(tiny_config(f"data.path={corpus}", "train.steps=42"), run, progress=False)


def test_metrics_hold_every_step_and_validation(trained_run):
    recs = read_records(trained_run)
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 41))
    assert [r["step"] for r in recs if r.get("event") == "eval"] == [20, 40]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert losses[-1] < losses[0] - 1.0  # it learns
    env = json.loads((trained_run / "env.json").read_text())
    assert env["backend"] == "cpu" and env["is_tpu"] is False and env["packages"]["jax"]


def test_non_finite_loss_stops_the_run_naming_step_and_checkpoint(tmp_path):
    with pytest.raises(
        TpulabError, match=r"loss is (nan|inf) at step \d+; last good checkpoint"
    ) as info:
        train(
            tiny_config("optim.lr=1e30", "optim.clip_norm=0", "train.steps=30"),
            tmp_path / "run",
            progress=False,
        )
    assert info.value.exit_code == ExitCode.BAD_STATE
