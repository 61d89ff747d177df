"""Exported endpoints: the manifest, fresh-process verification, and every rejection."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tpulab.errors import TpulabError


@pytest.fixture(scope="module")
def artifacts(trained_run, tmp_path_factory):
    from tpulab.inference.export import export_artifacts
    from tpulab.train.restore import load_model

    out = tmp_path_factory.mktemp("art") / "art"
    export_artifacts(load_model(trained_run), trained_run, out)
    return out


@pytest.fixture
def art_copy(artifacts, tmp_path):
    dst = tmp_path / "art"
    shutil.copytree(artifacts, dst)
    return dst


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, manifest):
    (path / "manifest.json").write_text(json.dumps(manifest))


def _rejects(art, capsys, *words, extra=()):
    from tpulab.cli.main import main

    rc = main(["verify-export", str(art), *extra])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, err
    return err


def test_manifest_records_identity_of_every_artifact(artifacts, trained_run):
    from tpulab.train.restore import load_model

    restored = load_model(trained_run)
    m = _manifest(artifacts)
    assert sorted(a["name"] for a in m["artifacts"]) == sorted(
        f"{e}_{p}" for e in ("prefill", "decode") for p in ("fp32", "bf16", "int8"))
    for a in m["artifacts"]:
        assert (artifacts / a["file"]).is_file() and len(a["sha256"]) == 64
        assert a["platforms"] == ["cpu", "tpu", "cuda"]
        assert a["checkpoint_step"] == restored.step == 40
        assert a["checkpoint_manifest_sha256"] == restored.checkpoint_digest
        assert a["jax"] and a["jaxlib"] and isinstance(a["calling_convention_version"], int)
        assert a["tokenizer"]["vocab_size"] == 258 and a["cache_policy"]["name"] in a["name"]
        assert a["inputs"] and a["outputs"] and all({"path", "shape", "dtype"} <= set(x) for x in a["inputs"])
    assert m["weights"]["passed_as"] == "arguments"


def test_exported_engine_generates_like_the_jitted_model(artifacts, trained_run):
    from tpulab.inference.decode import Decoder
    from tpulab.inference.export import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_ids
    from tpulab.train.restore import load_model

    cfg = SamplingConfig(max_new=12, temperature=0.9, top_k=40, seed=7)
    art = open_artifacts(artifacts)
    model = load_model(trained_run).model
    for policy in ("fp32", "int8"):
        got = list(generate_ids(art.engine(policy), "To be", cfg))
        want = list(generate_ids(Decoder.of(model, policy), "To be", cfg))
        assert got == want


def test_wrong_input_shape_or_dtype_is_rejected(artifacts):
    from tpulab.inference.export import open_artifacts

    engine = open_artifacts(artifacts).engine("fp32")
    s = engine.max_len
    with pytest.raises(TpulabError, match=r"tokens|\[1\]|expected int32\[1, 32\]"):
        engine.prefill(np.zeros((1, s + 1), np.int32), np.int32(3))
    with pytest.raises(TpulabError, match="expected int32"):
        engine.prefill(np.zeros((1, s), np.float32), np.int32(3))
    _, cache = engine.prefill(np.zeros((1, s), np.int32), np.int32(3))
    with pytest.raises(TpulabError, match="expected int32"):
        engine.decode(cache, np.zeros((1,), np.int64), np.int32(3))


def test_flipped_byte_is_rejected(art_copy, capsys):
    f = art_copy / "decode_int8.jaxexport"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    _rejects(art_copy, capsys, "sha256 mismatch", "decode_int8.jaxexport")


def test_manifest_edited_to_another_hash_is_rejected(art_copy, capsys):
    m = _manifest(art_copy)
    m["artifacts"][0]["sha256"] = "0" * 64
    _write_manifest(art_copy, m)
    _rejects(art_copy, capsys, "sha256 mismatch", m["artifacts"][0]["file"])


def test_missing_file_is_rejected(art_copy, capsys):
    (art_copy / "prefill_bf16.jaxexport").unlink()
    _rejects(art_copy, capsys, "missing file prefill_bf16.jaxexport")
    (art_copy / "manifest.json").unlink()
    _rejects(art_copy, capsys, "missing manifest.json")


def test_manifest_without_current_platform_is_rejected(art_copy, capsys):
    m = _manifest(art_copy)
    for a in m["artifacts"]:
        a["platforms"] = ["tpu", "cuda"]
    _write_manifest(art_copy, m)
    _rejects(art_copy, capsys, "not for this platform (cpu)")


def test_weights_from_another_checkpoint_are_rejected(art_copy, trained_run, tmp_path, capsys):
    from tpulab.checkpoint.files import sha256_file
    from tpulab.inference.export import export_artifacts
    from tpulab.train.restore import load_model

    other = tmp_path / "other"
    export_artifacts(load_model(trained_run, step=30), trained_run, other)
    # Swap in step 30's weights and make the hashes agree: only the checkpoint pairing can catch it.
    shutil.copy(other / "weights.npz", art_copy / "weights.npz")
    m = _manifest(art_copy)
    m["weights"]["sha256"] = sha256_file(art_copy / "weights.npz")
    _write_manifest(art_copy, m)
    _rejects(art_copy, capsys, "weights came from checkpoint")


def test_artifacts_against_another_run_checkpoint_are_rejected(artifacts, tmp_path, capsys):
    from tpulab.train.loop import train

    from conftest import tiny_config

    other_run = tmp_path / "other_run"
    train(tiny_config("train.steps=40", "seed=1"), other_run, progress=False)
    _rejects(artifacts, capsys, "the artifacts were exported from", extra=("--run-dir", str(other_run)))


@pytest.mark.slow
def test_verify_export_in_fresh_process_passes_bitwise(art_copy):
    from conftest import run_cli

    proc = run_cli("verify-export", str(art_copy))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "_" in line]
    assert len(rows) == 6 and all("PASS" in r for r in rows)
    assert all("| yes |" in r for r in rows if "fp32" in r)  # bitwise
    record = json.loads((art_copy / "verification.json").read_text())
    assert record["passed"] and record["platform"] == "cpu"
