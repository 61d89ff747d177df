"""`tpulab convert`: the tiny trained run (conftest's ``trained_run``) to its PyTorch twin and back.

The round trip is bitwise and goes back through ``load_model``'s verified path; every conversion
prints a per-layer table whose fp32 bounds hold. Each negative control breaks the conversion in one
place (the table, the state dict, the norm epsilon, the tied head) and must fail at its own first
layer, the layers before it still within their bounds. Bad input: one line, non-zero exit, nothing
written. The CLI runs in this process (``conftest.run_main``).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from conftest import run_main
from test_cli_errors import assert_one_line_error


def _cli(*args) -> tuple[int, str, str]:
    """``tpulab ARGS`` in this process, for a module fixture (``run_main`` needs a test's capfd)."""
    import contextlib
    import io

    from tpulab.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def converted(trained_run, tmp_path_factory):
    """One conversion each way, through the CLI: (torch file, run dir, what each printed)."""
    d = tmp_path_factory.mktemp("convert")
    rc, to_out, err = _cli(
        "convert", "--run-dir", trained_run, "--to", "torch", "--out", d / "t.pt"
    )
    assert rc == 0, err
    rc, back_out, err = _cli("convert", "--from", "torch", d / "t.pt", "--out", d / "back")
    assert rc == 0, err
    return d / "t.pt", d / "back", to_out, back_out


@pytest.fixture(scope="module")
def pair(trained_run):
    """The trained model, its config, its parameters by name, and the converted state dict."""
    from tpulab.bridge.convert import flat_params, flax_model, plain_config
    from tpulab.bridge.convert_table import to_torch
    from tpulab.train.restore import load_model

    r = load_model(trained_run)
    config = plain_config(r.config)
    flat = flat_params(r.plain_params())
    model, _ = flax_model(config, flat)
    return model, config, flat, to_torch(flat, config.model)


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_round_trip_is_bitwise_and_loads_through_the_verified_path(trained_run, converted):
    from tpulab.bridge.convert import flat_params
    from tpulab.train.restore import load_model

    _, back, _, _ = converted
    src, dst = load_model(trained_run), load_model(back)
    a, b = flat_params(src.plain_params()), flat_params(dst.plain_params())
    assert sorted(a) == sorted(b) and len(a) == 2 + 6 * 2  # embed, final norm, 6 per block
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name
    assert dst.step == src.step == 40
    assert dst.config.model == src.config.model


def test_both_tables_hold_every_bound_and_greedy_generations_agree(converted):
    from tpulab.bridge.layers import BOUNDS, layer_names

    path, _, to_out, back_out = converted
    doc = _load(path)
    check = doc["check"]
    names = layer_names(_model_config(doc))
    assert [r["layer"] for r in check["layers"]] == names
    assert names[:3] == ["embed", "blocks.0.attn_norm", "blocks.0.attn"] and names[-1] == "logits"
    for r in check["layers"]:
        assert r["over"] == [] and r["rel_l2"] <= BOUNDS.rel_l2 and r["cosine"] >= BOUNDS.cosine
    assert check["passed"] and check["first_failure"] is None
    assert check["kl"]["max"] <= BOUNDS.kl and check["kl"]["tokens"] == 8 * 32
    g = check["greedy"]
    assert g["equal"] and g["prompts"] == 4 and g["new_tokens"] == 8
    for out, direction in ((to_out, "tpulab -> torch"), (back_out, "torch -> tpulab")):
        assert f"converted {direction}: every layer within its fp32 bound" in out
        assert "| blocks.1.mlp |" in out and "Per-token KL" in out


def _model_config(doc):
    from tpulab.config import from_dict
    from tpulab.model.config import ModelConfig

    return from_dict(ModelConfig, doc["model_config"])


def test_torch_file_describes_itself(trained_run, converted):
    from tpulab.bridge.convert_table import FORMAT, tensor_sha256
    from tpulab.train.restore import load_model

    doc = _load(converted[0])
    assert doc["format"] == FORMAT and doc["norm_eps"] == 1e-6
    assert doc["source"]["checkpoint_digest"] == load_model(trained_run).checkpoint_digest
    assert set(doc["sha256"]) == set(doc["state_dict"])
    assert all(tensor_sha256(v) == doc["sha256"][k] for k, v in doc["state_dict"].items())
    assert "head.weight" not in doc["state_dict"]  # tied: the head is the embedding
    assert doc["state_dict"]["blocks.0.attn.qkv.weight"].shape == (96, 32)  # [out, in]


def test_flax_hooks_leave_the_classes_as_they_were(pair):
    from tpulab.bridge.layers import flax_outputs
    from tpulab.model.transformer import Block, RMSNorm

    before = (RMSNorm.__call__, Block.__call__)
    flax_outputs(pair[0], np.zeros((1, 4), np.int32))
    assert (RMSNorm.__call__, Block.__call__) == before


# --- negative controls: each fails at its own first layer -----------------------------------------


def _first_failure(pair, twin):
    from tpulab.bridge.convert import check_conversion

    r = check_conversion(pair[0], twin, pair[1], "tpulab")
    assert not r["passed"]
    first = r["first_failure"]["layer"]
    before = [x["layer"] for x in r["layers"]][: [x["layer"] for x in r["layers"]].index(first)]
    assert all(not x["over"] for x in r["layers"] if x["layer"] in before)
    return first, r


def test_one_transposed_kernel_in_the_table_fails_at_block_0_attention(trained_run, tmp_path):
    """attn.out is square, so its missing transpose passes every shape check."""
    from tpulab.bridge.convert import How, to_torch_file
    from tpulab.bridge.convert_table import TABLE
    from tpulab.errors import TpulabError

    table = tuple(
        dataclasses.replace(e, transpose=False) if e.torch.endswith("attn.out.weight") else e
        for e in TABLE
    )
    with pytest.raises(TpulabError, match=r"first layer over its fp32 bound: blocks\.0\.attn \("):
        to_torch_file(trained_run, tmp_path / "t.pt", How(table=table))
    assert not (tmp_path / "t.pt").exists()


def test_q_and_k_swapped_in_block_1_fails_at_its_attention(pair):
    from tpulab.bridge.convert_table import load_twin

    _, config, _, sd = pair
    d = config.model.d_model
    w = sd["blocks.1.attn.qkv.weight"]
    bad = {**sd, "blocks.1.attn.qkv.weight": torch.cat([w[d : 2 * d], w[:d], w[2 * d :]])}
    first, r = _first_failure(pair, load_twin(bad, config.model, 1e-6, "control"))
    assert first == "blocks.1.attn"
    assert r["layers"][0]["max_abs"] == 0.0  # the embedding is copied bit for bit


def test_a_wrong_norm_epsilon_fails_at_the_first_norm(pair, converted, tmp_path, capfd):
    """LayerNorm's usual 1e-5 where tpulab's RMSNorm adds 1e-6: through the library, and through
    `convert --from torch` with a file whose header says so (its tensors still verify)."""
    from tpulab.bridge.convert_table import load_twin

    _, config, _, sd = pair
    first, _ = _first_failure(pair, load_twin(sd, config.model, 1e-5, "control"))
    assert first == "blocks.0.attn_norm"
    doc = _load(converted[0])
    doc["norm_eps"] = 1e-5
    torch.save(doc, tmp_path / "eps.pt")
    result = run_main(
        capfd, "convert", "--from", "torch", tmp_path / "eps.pt", "--out", tmp_path / "o"
    )
    assert_one_line_error(result, "blocks.0.attn_norm (", "nothing written")
    assert not (tmp_path / "o").exists()


def test_an_untied_head_left_at_its_init_fails_at_the_logits(pair):
    """The tied-embedding mistake: a twin built untied, the embedding loaded, the head not."""
    from tpulab.bridge.twin import TorchTransformer

    _, config, _, sd = pair
    twin = TorchTransformer(dataclasses.replace(config.model, tie_embeddings=False))
    missing = twin.load_state_dict(sd, strict=False).missing_keys
    assert missing == ["head.weight"]
    first, r = _first_failure(pair, twin.eval())
    assert first == "logits" and r["layers"][-2]["layer"] == "final_norm"


def test_the_greedy_comparison_can_fail(pair):
    from tpulab.bridge.convert import greedy_pair
    from tpulab.bridge.convert_table import load_twin
    from tpulab.inference.cache_eval import heldout_windows

    model, config, _, sd = pair
    bad = {**sd, "final_norm.weight": -sd["final_norm.weight"]}  # argmax -> argmin
    g = greedy_pair(
        model, load_twin(bad, config.model, 1e-6, "control"), heldout_windows(config, 32)
    )
    assert not g["equal"] and g["first_difference"] is not None


# --- bad input: one line, non-zero exit, nothing written ------------------------------------------


def test_a_run_dir_without_a_verified_checkpoint(trained_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for manifest in run.glob("checkpoints/*/tpulab_manifest.json"):
        manifest.unlink()  # every step unverifiable
    for d in (run, tmp_path / "empty"):
        d.mkdir(exist_ok=True)
        r = run_main(capfd, "convert", "--run-dir", d, "--to", "torch", "--out", tmp_path / "t.pt")
        assert_one_line_error(r, "checkpoint")
    assert not (tmp_path / "t.pt").exists()


def _edited(converted, tmp_path, edit):
    doc = _load(converted[0])
    edit(doc["state_dict"], doc["sha256"])
    torch.save(doc, tmp_path / "bad.pt")
    return tmp_path / "bad.pt"


def _reshaped(sd, sums):
    sd["blocks.1.mlp.up.weight"] = torch.zeros(64, 32)
    sums["blocks.1.mlp.up.weight"] = None


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda sd, s: sd.pop("blocks.1.mlp.up.weight"), "lacks tensor blocks.1.mlp.up.weight"),
        (
            lambda sd, s: sd.update({"blocks.0.attn.qkv.bias": torch.zeros(96)}),
            "has tensor blocks.0.attn.qkv.bias",
        ),
        (
            _reshaped,
            "tensor blocks.1.mlp.up.weight has shape [64, 32], the config makes it [128, 32]",
        ),
        (
            lambda sd, s: sd["blocks.0.attn.out.weight"].mul_(1.0001),
            "tensor blocks.0.attn.out.weight does not match its recorded sha256",
        ),
    ],
    ids=["missing", "extra", "another-shape", "changed"],
)
def test_a_torch_file_with_a_missing_extra_reshaped_or_changed_tensor(
    converted, tmp_path, capfd, edit, needle
):
    bad = _edited(converted, tmp_path, edit)
    r = run_main(capfd, "convert", "--from", "torch", bad, "--out", tmp_path / "o")
    assert_one_line_error(r, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--to", "torch"], "give either --run-dir D --to torch, or --from torch FILE"),
        (["--from", "keras", "X"], "--from keras: the format must be torch"),
        (["--from", "torch", "NOFILE"], "NOFILE does not exist"),
        (["--from", "torch", "GARBAGE"], "is not a readable torch file"),
    ],
)
def test_bad_arguments(tmp_path, capfd, argv, needle):
    (tmp_path / "GARBAGE").write_bytes(b"not a torch file")
    argv = [str(tmp_path / a) if a in ("NOFILE", "GARBAGE") else a for a in argv]
    r = run_main(capfd, "convert", *argv, "--out", tmp_path / "o")
    assert_one_line_error(r, needle)
    assert not (tmp_path / "o").exists()


def test_an_existing_out_is_never_overwritten(trained_run, converted, capfd):
    path = converted[0]
    before = path.read_bytes()
    r = run_main(capfd, "convert", "--run-dir", trained_run, "--to", "torch", "--out", path)
    assert_one_line_error(r, "already exists")
    assert path.read_bytes() == before


def test_a_lora_run_converts_as_its_merged_model(trained_run, tmp_path):
    """A post-trained run goes through the same code: a LoRA SFT run's adapters merged into its
    base (``Restored.plain_params``), written back as a plain pretraining-kind model run."""
    from conftest import tiny_config
    from tpulab.bridge.convert import flat_params, from_torch_file, to_torch_file
    from tpulab.train.loop import train
    from tpulab.train.restore import load_model

    sets = ("objective.kind=sft", f"objective.init={trained_run}", "objective.lora.rank=4")
    cfg = tiny_config(*sets, "train.steps=4", "train.eval_every=4", "checkpoint.save_every=4")
    train(cfg, tmp_path / "lora", progress=False)
    to = to_torch_file(tmp_path / "lora", tmp_path / "l.pt")
    assert to["passed"] and to["greedy"]["equal"]
    back = from_torch_file(tmp_path / "l.pt", tmp_path / "back")
    assert back["passed"]
    src, dst = load_model(tmp_path / "lora"), load_model(tmp_path / "back")
    assert dst.config.objective.kind == "pretrain" and dst.config.objective.lora.rank == 0
    a, b = flat_params(src.plain_params()), flat_params(dst.plain_params())
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)
    base = flat_params(src.base.plain_params())  # the adapters did change the weights
    assert not np.array_equal(a["blocks.0.attn.qkv.kernel"], base["blocks.0.attn.qkv.kernel"])
