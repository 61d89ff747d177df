"""SFT on the one loop: the dialogue data, the response-only mask proofs, LoRA, merge, identities.

Each proof has a negative control that makes it fail. Sizes are the tiny test config's; the base
is the session's ``trained_run`` (tiny pretraining, 40 steps), read only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, frozen_tamper_error, run_cli, tiny_config
from tpulab.checkpoint.files import MANIFEST
from tpulab.data import dialogue as D
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import split_documents
from tpulab.data.tokenizer import PAD
from tpulab.errors import ConfigError, TpulabError
from tpulab.evidence.metrics import curve, read_records
from tpulab.train.loop import train
from tpulab.train.merge import merge_lora
from tpulab.train.objectives import build
from tpulab.train.restore import load_model
from tpulab.train.step import make_mesh, masked_xent, tree_digest


def sft_sets(base: Path) -> list[str]:
    """The tiny SFT run of these tests, as --set overrides: 12 steps from ``base``."""
    return [
        "objective.kind=sft",
        f"objective.init={base}",
        "train.steps=12",
        "train.eval_every=6",
        "checkpoint.save_every=6",
    ]


def sft_config(base: Path, *extra: str):
    return tiny_config(*sft_sets(base), *extra)


@pytest.fixture(scope="session")
def tiny_dialogue():
    cfg = tiny_config()
    return D.from_plays(load_corpus(cfg.data.path), cfg.data), cfg


@pytest.fixture(scope="session")
def lora_run(trained_run, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lora") / "run"
    train(sft_config(trained_run, "objective.lora.rank=4"), run, progress=False)
    return run


# --- the data ----------------------------------------------------------------------------------


def test_every_pair_is_framed_and_its_mask_covers_the_response_and_stop_byte_only(tiny_dialogue):
    d, cfg = tiny_dialogue
    rows = D.encode(d.train, cfg.data.seq_len)
    batch = D.to_batch(rows)
    for i, pair in enumerate(d.train):
        targets, mask = batch["targets"][i], batch["mask"][i] > 0
        assert bytes(targets[mask].astype(np.uint8)) == pair.response + bytes([D.STOP])
        assert not mask[targets == PAD].any()
    # negative control: the check reads what the mask says (an all-ones mask includes the prompt)
    ones = np.ones_like(batch["mask"][0]) > 0
    assert bytes(batch["targets"][0][ones & (batch["targets"][0] != PAD)].astype(np.uint8)) != (
        d.train[0].response + bytes([D.STOP])
    )


def test_the_held_out_plays_are_the_pretraining_validation_documents(tiny_dialogue):
    d, cfg = tiny_dialogue
    _, val_docs = split_documents(load_corpus(cfg.data.path), cfg.data)
    held_out = {doc.name for doc in val_docs}
    assert {p.source for p in d.eval} <= held_out
    assert not {p.source for p in d.train} & held_out


def test_pairs_fit_the_tiny_context_by_cutting_the_cue_from_the_left(tiny_dialogue):
    d, cfg = tiny_dialogue
    assert len(d.train) > 20 and all(1 + len(D.framed(p)) <= cfg.data.seq_len + 1 for p in d.train)
    long = D.Pair(b"KING.\n" + b"word " * 40 + b"\n\nHAM.\n", b"Ay.", "x")
    cut = D.fit(long, 32)
    assert cut is not None and cut.prompt.startswith(b"KING.\n") and cut.prompt.endswith(b"HAM.\n")
    assert cut.response == b"Ay." and 1 + len(D.framed(cut)) <= 33
    assert D.fit(D.Pair(b"A.\nx\n\nB.\n", b"y" * 40, "x"), 32) is None  # the response cannot fit


def test_a_corpus_holding_a_delimiter_byte_is_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"KING.\nHow now\x02?\n")
    (tmp_path / "b.txt").write_bytes(b"HAM.\nWell.\n")
    with pytest.raises(TpulabError, match="0x02"):
        D.from_plays(load_corpus(str(tmp_path)), tiny_config().data)


@pytest.mark.parametrize(
    "line, why",
    [
        (b"{not json", "not valid JSON"),
        (b'{"prompt": "a\xff", "response": "b"}', "not UTF-8"),
        (b'{"prompt": "a"}', "'response' is missing"),
        (b'{"prompt": "a", "response": ""}', "empty"),
        (b'{"prompt": "a\\u0002", "response": "b"}', "delimiter"),
        (b'{"prompt": "' + b"x" * 40 + b'", "response": "b"}', "longer than the context"),
    ],
)
def test_a_bad_jsonl_line_is_refused_with_its_file_and_line(tmp_path, line, why):
    good = b'{"prompt": "Who?", "response": "Me."}'
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    with pytest.raises(TpulabError, match=why) as e:
        D.from_jsonl(path, tiny_config().data)
    assert f"{path}:2" in str(e.value)
    path.write_bytes(good + b"\n" + good + b"\n")  # control: the good lines alone load
    assert len(D.from_jsonl(path, tiny_config().data).train) == 1


def test_batches_whose_mask_trains_on_nothing_or_everything_are_errors(tiny_dialogue):
    d, cfg = tiny_dialogue
    batch = D.to_batch(D.encode(d.train[:8], cfg.data.seq_len))
    D.check_batch(batch)  # control: a real batch passes
    for bad in (np.zeros_like(batch["mask"]), np.ones_like(batch["mask"])):
        with pytest.raises(TpulabError, match="all-"):
            D.check_batch({**batch, "mask": bad})


# --- the mask proofs ---------------------------------------------------------------------------


def test_the_loss_gradient_at_prompt_and_padding_positions_is_exactly_zero(tiny_dialogue):
    d, cfg = tiny_dialogue
    batch = D.to_batch(D.encode(d.train[:8], cfg.data.seq_len))
    logits = jax.random.normal(jax.random.PRNGKey(0), (*batch["targets"].shape, 258))

    def grad(mask):
        return np.asarray(jax.grad(lambda z: masked_xent(z, batch["targets"], mask)[0])(logits))

    g = grad(jnp.asarray(batch["mask"]))
    outside = batch["mask"] == 0
    assert (g[outside] == 0).all() and (g[~outside] != 0).any(axis=-1).all()
    # negative control: a loss that ignores the mask has gradient at the prompt positions
    assert (grad(jnp.ones_like(batch["mask"]))[outside] != 0).any()


def test_changing_the_prompt_targets_changes_neither_loss_nor_gradient(trained_run):
    """Through the SFT objective's own jitted train step (loss and the gradient it applies)."""
    cfg = sft_config(trained_run)
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    batch = next(obj.data().train(0, 1))
    other = dict(batch, targets=np.where(batch["mask"] > 0, batch["targets"], 7))
    ignoring = dict(other, mask=np.ones_like(batch["mask"]))  # negative control

    def one_step(b):
        state, metrics = steps.train(steps.init(), steps.put_batch(b))
        # Adam's first moment is (1 - b1) * gradient after one step (the step-1 lr is 0)
        return float(metrics["loss"]), tree_digest(state.opt_state)

    a, b, c = one_step(batch), one_step(other), one_step(ignoring)
    assert a == b  # loss and gradient (through the moments) bitwise equal
    assert c[0] != a[0] and c[1] != a[1]


# --- runs: SFT and LoRA on the loop ------------------------------------------------------------


def test_sft_trains_from_its_base_and_records_its_identities(trained_run, tmp_path):
    run = tmp_path / "sft"
    summary = train(sft_config(trained_run), run, progress=False)
    base = load_model(trained_run)
    ids = summary.identities
    assert ids["base"] == base.checkpoint_digest and len(ids["dataset"]) == 64
    recs = read_records(run)
    first = next(r for r in recs if r.get("step") == 1)
    assert first["tokens"] > 0 and isinstance(first["tokens"], int)
    evals = [r for r in recs if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [6, 12] and all(np.isfinite(e["val_loss"]) for e in evals)
    assert len(curve(recs)) == 12


def test_a_resume_onto_another_base_is_refused_and_changes_nothing(trained_run, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(trained_run, base)
    run = tmp_path / "sft"
    train(sft_config(base, "train.steps=6"), run, progress=False)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    # the base run trains on: its newest checkpoint (what objective.init names) is another model
    train(tiny_config("train.steps=50"), base, progress=False)
    with pytest.raises(TpulabError, match="refusing to resume step 6: .*base"):
        train(sft_config(base), run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "rejected_checkpoints").exists()


def test_a_missing_corrupt_or_foreign_base_is_one_line(trained_run, tmp_path):
    with pytest.raises(TpulabError, match="holds no checkpoints"):
        build(sft_config(tmp_path / "nowhere"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(trained_run, corrupt)
    for step in (corrupt / "checkpoints").iterdir():
        (step / MANIFEST).write_text("{}")
    with pytest.raises(TpulabError, match="valid"):
        build(sft_config(corrupt))
    with pytest.raises(TpulabError, match="another shape.*d_model"):
        build(sft_config(trained_run, "model.d_model=64"))


def test_lora_step0_logits_are_bitwise_the_base_models(trained_run):
    cfg = sft_config(trained_run, "objective.lora.rank=4")
    steps = build(cfg).steps(make_mesh(cfg))
    state = steps.init()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 32)), jnp.int32)
    adapted = np.asarray(steps.model(state.params)(tokens, deterministic=True))
    base = np.asarray(load_model(trained_run).model(tokens, deterministic=True))
    assert adapted.tobytes() == base.tobytes()
    # negative control: with B no longer zero the adapter changes the logits
    bumped = jax.tree.map(lambda x: x + 0.05, state.params)
    assert np.asarray(steps.model(bumped)(tokens, deterministic=True)).tobytes() != base.tobytes()


def test_lora_trains_only_the_adapters_and_leaves_the_base_bitwise(trained_run, lora_run):
    restored = load_model(lora_run)
    base = load_model(trained_run)
    assert tree_digest(restored.base.state.params) == tree_digest(base.state.params)
    env = json.loads((lora_run / "env.json").read_text())
    n_adapter = env["lora"]["adapter_params"]
    assert env["trained_param_count"] == n_adapter > 0
    # Adam's two moments over the adapters (plus its count), not over the base
    assert env["optimizer_state_bytes"] < 3 * 4 * n_adapter
    assert env["lora"]["base_params"] > 5 * n_adapter
    meta = json.loads((restored.checkpoint_dir / "meta" / "metadata").read_text())
    lo = meta["config"]["objective"]["lora"]
    assert lo["rank"] == 4 and lo["alpha"] == 16.0 and lo["targets"]
    assert meta["identities"]["base"] == base.checkpoint_digest


def test_a_changed_frozen_base_is_caught_at_the_end_of_the_run(trained_run, tmp_path):
    """Negative control for the loop's frozen-weights check: a hook edits the frozen base."""
    cfg = sft_config(trained_run, "objective.lora.rank=4", "train.steps=3")

    def edit(frozen):
        leaf = frozen["blocks"][0]["attn"]["qkv"]["kernel"]
        leaf[...] = leaf[...] + 1.0

    frozen_tamper_error(cfg, tmp_path / "run", 2, edit)


def test_lora_errors_are_one_line(trained_run):
    with pytest.raises(ConfigError, match="matches no projection.*blocks/0/attn/qkv"):
        build(sft_config(trained_run, "objective.lora.rank=4", "objective.lora.targets=[attn/q$]"))
    for bad, why in (("rank=-1", "must be in"), ("rank=33", "exceeds"), ("alpha=.inf", "finite")):
        with pytest.raises(ConfigError, match=why):
            sft_config(trained_run, f"objective.lora.{bad}")


def test_merge_writes_a_plain_model_within_the_bound_and_resuming_it_is_refused(
    trained_run, lora_run, tmp_path
):
    out = tmp_path / "merged"
    record = merge_lora(lora_run, out)
    assert record["max_relative_logit_diff"] <= 1e-5 and record["adapted_matrices"] == 8
    merged, adapted = load_model(out), load_model(lora_run)
    assert merged.base is None and merged.config.objective.lora.rank == 0
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 32)), jnp.int32)
    a = np.asarray(adapted.model(tokens, deterministic=True))
    b = np.asarray(merged.model(tokens, deterministic=True))
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a))
    assert (a.argmax(-1) == b.argmax(-1)).all()  # greedy choices identical on the probe
    with pytest.raises(TpulabError, match="merged model, not a training state"):
        train(merged.config, out, progress=False)
    with pytest.raises(TpulabError, match="not a LoRA run"):
        merge_lora(trained_run, tmp_path / "again")


# --- kill/resume proofs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(trained_run, tmp_path_factory) -> dict[int, Path]:
    """The uninterrupted SFT (rank 0) and LoRA (rank 4) runs of the proofs and the chaos run
    below, each trained once in-process (the proofs need no reference child)."""
    runs = {}
    for rank in (0, 4):
        run = tmp_path_factory.mktemp(f"sft-ref-{rank}") / "run"
        sets = (*sft_sets(trained_run), f"objective.lora.rank={rank}", *LONGER)
        train(tiny_config(*sets), run, progress=False)
        runs[rank] = run
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 4])
def test_sft_and_lora_kill_resume_is_bitwise(trained_run, references, tmp_path, rank):
    """The kill/resume proof on SFT (rank 0: `tpulab prove-resume`, a real CLI process) and LoRA
    (rank 4: the same driver called here), each against its in-process ``references`` run:
    per-step losses and the whole final state (adapters or weights, Adam moments, step, dropout
    key, data position) bitwise. Rank 0's resumed process compiles on a fresh, empty cache (the
    post-training proofs' one cold resume, asserted from JAX's cache events); every other
    post-training proof resumes on the shared warm cache."""
    from tpulab.proofs.transformer import prove_transformer_resume

    sets = (*sft_sets(trained_run), f"objective.lora.rank={rank}", *LONGER)
    if rank:
        prove_transformer_resume(
            tiny_config(*sets),
            tmp_path,
            reference_dir=references[rank],
            warm_resume_cache=True,
            track=False,  # tracking is tests/test_tracking.py's
        )
    else:
        result = run_cli(
            *("prove-resume", "--no-track", "--run-dir", str(tmp_path), "--config", str(TINY)),
            *(a for s in sets for a in ("--set", s)),
            *("--reference", str(references[rank])),
        )
        assert result.returncode == 0, result.stderr + result.stdout
    v = json.loads((tmp_path / "proof" / "verdict.json").read_text())
    assert v["identical"] and v["curves_identical"] and v["final_state_identical"]
    assert v["steps_compared"] == 16 and v["kill_step"] == 9 and v["resumed_from_step"] in (4, 8)
    assert v["reference_dir"] == str(references[rank])
    resumed = v["compile_cache"]["processes"]["resumed"]
    assert resumed["cold"] is (not rank), resumed
    if not rank:  # it looked its programs up in a cache dir that held none
        assert resumed.get("cold_confirmed") is True, resumed


@pytest.mark.slow
def test_lora_chaos_random_kills_end_identical(trained_run, references, tmp_path):
    """`tpulab chaos`'s driver, called here, on LoRA: one random SIGKILL (the fixed-point proof
    above covers the rest; 2 cost ~60 s more), against ``references[4]``."""
    from tpulab.proofs.chaos import run_chaos

    cfg = sft_config(trained_run, "objective.lora.rank=4", *LONGER)
    run_chaos(
        cfg,
        tmp_path,
        kills=1,
        seed=1,
        reference_dir=references[4],
        warm_resume_cache=True,  # the rank-0 proof above resumes cold
        track=False,  # tracking is tests/test_tracking.py's
    )
    v = json.loads((tmp_path / "chaos" / "verdict.json").read_text())
    assert v["reference_dir"] == str(references[4])
    assert v["identical"] and v["final_state_identical"] and v["kills"] == 1


# Room to kill between checkpoints: the kill lands at step 9, after the saves of steps 4 and 8.
LONGER = ("train.steps=16", "checkpoint.save_every=4", "train.eval_every=8")


def test_merge_into_a_used_out_is_refused_unless_it_is_the_same_merge(lora_run, tmp_path):
    def snap(d):
        return sorted((str(p.relative_to(d)), p.stat().st_mtime_ns) for p in d.rglob("*"))

    kept = tmp_path / "kept"  # a user's files where the merge would write its own
    kept.mkdir()
    (kept / "config.yaml").write_text("mine: true\n")
    (kept / "merge.json").write_text('{"mine": true}\n')
    with pytest.raises(TpulabError, match=r"\(config.yaml is in the way\)"):
        merge_lora(lora_run, kept)
    assert (kept / "config.yaml").read_text() == "mine: true\n" and len(snap(kept)) == 2
    out = tmp_path / "merged"
    first = merge_lora(lora_run, out)
    before = snap(out)
    again = merge_lora(lora_run, out)  # the same adapters: the earlier merge, nothing written
    assert again == {**first, "reused": True} and snap(out) == before
    # negative controls: a record of other adapters, or a merged checkpoint that no longer
    # verifies, is no earlier merge of these
    record = json.loads((out / "merge.json").read_text())
    (out / "merge.json").write_text(json.dumps({**record, "source_checkpoint_digest": "0" * 64}))
    with pytest.raises(TpulabError, match=r"\(checkpoints is in the way\)"):
        merge_lora(lora_run, out)
    (out / "merge.json").write_text(json.dumps(record))
    assert merge_lora(lora_run, out)["reused"]
    step = next((out / "checkpoints").iterdir())
    (step / MANIFEST).write_text("{}")
    with pytest.raises(TpulabError, match="in the way"):
        merge_lora(lora_run, out)
