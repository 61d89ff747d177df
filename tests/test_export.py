"""Exported endpoints: the manifest, fresh-process verification, and every rejection."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil

import numpy as np
import pytest

from conftest import verified_export
from tpulab.errors import TpulabError


@pytest.fixture(scope="module")
def artifacts(trained_run, tmp_path_factory):
    """The run's step-40 (latest) export, never verified: the suite's shared export
    (``conftest.verified_export``, exported once per pytest run) copied without the one file
    verification adds (``verification.json``), so the same files ``export_artifacts`` wrote."""
    from tpulab.inference.artifact_format import VERIFICATION

    out = tmp_path_factory.mktemp("art") / "art"
    shared = verified_export(trained_run, tmp_path_factory, 40)
    shutil.copytree(shared, out, ignore=shutil.ignore_patterns(VERIFICATION))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in shared.iterdir() if p.name != VERIFICATION
    )
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
        f"{e}_{p}" for e in ("prefill", "decode", "generate") for p in ("fp32", "bf16", "int8")
    )
    for a in m["artifacts"]:
        assert (artifacts / a["file"]).is_file() and len(a["sha256"]) == 64
        assert a["platforms"] == ["cpu", "tpu", "cuda"]
        assert a["checkpoint_step"] == restored.step == 40
        assert a["checkpoint_manifest_sha256"] == restored.checkpoint_digest
        assert a["jax"] and a["jaxlib"] and isinstance(a["calling_convention_version"], int)
        assert a["tokenizer"]["vocab_size"] == 258 and a["cache_policy"]["name"] in a["name"]
        assert (
            a["inputs"]
            and a["outputs"]
            and all({"path", "shape", "dtype"} <= set(x) for x in a["inputs"])
        )
    assert m["weights"]["passed_as"] == "arguments"
    from tpulab.inference.artifact_format import tensor_sha256
    from tpulab.model.decode import ModelFns

    params = ModelFns(restored.model).params
    assert set(m["weights"]["tensors"]) == set(params)
    for n, x in params.items():
        assert m["weights"]["tensors"][n]["sha256"] == tensor_sha256(np.asarray(x))
    loop = next(a for a in m["artifacts"] if a["name"] == "generate_fp32")
    assert loop["inputs"][-2]["shape"] == ["b", 2]  # one artifact for every request batch


def test_exported_engine_generates_like_the_jitted_model(artifacts, trained_run):
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.inference.generate import SamplingConfig, generate_ids
    from tpulab.model.decode import Decoder
    from tpulab.train.restore import load_model

    cfg = SamplingConfig(max_new=12, temperature=0.9, top_k=40, seed=7)
    art = open_artifacts(artifacts)
    model = load_model(trained_run).model
    from tpulab.inference.generate import Request, generate_batch

    for policy in ("fp32", "int8"):
        got = list(generate_ids(art.engine(policy), "To be", cfg))
        want = list(generate_ids(Decoder.of(model, policy), "To be", cfg))
        assert got == want
        reqs = [Request.of(p, cfg, 32) for p in ("To be", "ROMEO:", "a")]
        assert generate_batch(art.engine(policy), reqs)[0] == want


def _missing(engine, protocol) -> list[str]:
    listed = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return sorted(n for n in listed | set(protocol.__annotations__) if not hasattr(engine, n))


def test_both_engines_have_what_the_engine_protocol_lists(artifacts, trained_run):
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.model.decode import Decoder, Engine
    from tpulab.train.restore import load_model

    called = {"prefill", "decode", "generate", "batch_for", "width_for", "compiled_variants"}
    assert called <= set(vars(Engine)) and {"policy", "max_len", "batch"} <= set(
        Engine.__annotations__
    )
    exported = open_artifacts(artifacts).engine("fp32")
    for engine in (exported, Decoder.of(load_model(trained_run).model, "fp32")):
        assert _missing(engine, Engine) == [], type(engine)
        variants = engine.compiled_variants()  # one type in both engines
        assert isinstance(variants, dict) and isinstance(variants["generate"], int), variants

    class NoBuckets:  # control: an engine without the loop's bucket methods is caught
        policy, max_len, batch = "fp32", 32, 1
        prefill = decode = generate = compiled_variants = exported.prefill

    assert _missing(NoBuckets(), Engine) == ["batch_for", "width_for"]


def test_wrong_input_shape_or_dtype_is_rejected(artifacts):
    from tpulab.inference.artifacts import open_artifacts

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


def test_weights_from_another_checkpoint_are_rejected(
    art_copy, trained_run, tmp_path_factory, capsys
):
    from tpulab.checkpoint.files import sha256_file

    # Another checkpoint's weights: step 20's, from the suite's shared step-20 export (read only).
    other = verified_export(trained_run, tmp_path_factory, 20)
    # Swap in step 20's weights and make the hashes agree: only the checkpoint pairing can catch it.
    shutil.copy(other / "weights.npz", art_copy / "weights.npz")
    m = _manifest(art_copy)
    m["weights"]["sha256"] = sha256_file(art_copy / "weights.npz")
    _write_manifest(art_copy, m)
    _rejects(art_copy, capsys, "weights came from checkpoint")


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """A second run (another seed): for the true run's artifacts, a foreign or forged checkpoint."""
    from conftest import tiny_config
    from tpulab.train.loop import train

    run = tmp_path_factory.mktemp("other") / "other_run"
    train(tiny_config("train.steps=40", "seed=1"), run, progress=False)
    return run


def test_artifacts_against_another_run_checkpoint_are_rejected(artifacts, other_run, capsys):
    _rejects(
        artifacts, capsys, "the artifacts were exported from", extra=("--run-dir", str(other_run))
    )


@pytest.mark.slow
def test_verify_export_in_fresh_process_passes_bitwise(art_copy):
    from conftest import run_cli

    proc = run_cli("verify-export", str(art_copy))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "_" in line]
    assert len(rows) == 9 and all("PASS" in r for r in rows)
    assert all("| yes |" in r for r in rows if "fp32" in r)  # bitwise
    record = json.loads((art_copy / "verification.json").read_text())
    assert record["passed"] and record["platform"] == "cpu"


# --- Bound weights, corrupt and swapped artifacts, and what generate/serve load -------------------


def _rehash(art, *files):
    from tpulab.checkpoint.files import sha256_file

    m = _manifest(art)
    for entry in [*m["artifacts"], m["weights"]]:
        if entry["file"] in files:
            entry["sha256"] = sha256_file(art / entry["file"])
    _write_manifest(art, m)


def _forge_weights(art, rehash_tensor=True):
    """Change one weight tensor slightly, keep its checkpoint digest, rehash the manifest to
    match."""
    from tpulab.inference.artifact_format import tensor_sha256

    with np.load(art / "weights.npz") as z:
        params = {k: z[k] for k in z.files}
    name = sorted(k for k in params if "mlp" in k)[0]
    params[name] = (params[name] * np.float32(1.001)).astype(params[name].dtype)
    with open(art / "weights.npz", "wb") as f:
        np.savez(f, **params)
    if rehash_tensor:
        m = _manifest(art)
        m["weights"]["tensors"][name]["sha256"] = tensor_sha256(params[name])
        _write_manifest(art, m)
    _rehash(art, "weights.npz")
    return name


def _forge_record(art):
    """Rewrite verification.json to match whatever the directory now holds (what an attacker can
    do)."""
    from tpulab.checkpoint.files import sha256_file

    rec = json.loads((art / "verification.json").read_text())
    rec.pop("hmac_sha256", None)
    m = _manifest(art)
    rec["manifest_sha256"] = sha256_file(art / "manifest.json")
    rec["files_sha256"] = {
        e["file"]: sha256_file(art / e["file"]) for e in [*m["artifacts"], m["weights"]]
    }
    (art / "verification.json").write_text(json.dumps(rec))


@pytest.fixture(scope="module")
def verified(artifacts, trained_run, tmp_path_factory):
    """A copy of the artifacts verified in-process, the record signed with a key."""
    from tpulab.inference.trust import verify_export

    dst = tmp_path_factory.mktemp("verified") / "art"
    shutil.copytree(artifacts, dst)
    key = dst.parent / "key"
    key.write_bytes(b"0123456789abcdef-test-key")
    assert verify_export(dst, trained_run, key=key.read_bytes())["passed"]
    return dst, key


@pytest.fixture
def verified_copy(verified, tmp_path):
    dst = tmp_path / "verified_art"
    shutil.copytree(verified[0], dst)
    return dst, verified[1]


def _generate(capsys, art, *extra):
    from tpulab.cli.main import main

    rc = main(
        [
            "generate",
            "--artifacts",
            str(art),
            "--prompt",
            "To",
            "--max-new",
            "4",
            "--temperature",
            "0",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    return rc, out, err


def test_forged_weights_are_refused_tensor_by_tensor(art_copy, capsys):
    name = _forge_weights(
        art_copy
    )  # every hash agrees with the forged file; only the checkpoint can tell
    _rejects(art_copy, capsys, f"tensor {name} differs from checkpoint step 40")


def test_weights_not_matching_their_recorded_tensor_hash_are_refused(art_copy, capsys):
    name = _forge_weights(art_copy, rehash_tensor=False)
    _rejects(art_copy, capsys, f"tensor {name} does not have the sha256 recorded")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_artifact_with_rehashed_manifest_is_refused(art_copy, capsys, damage):
    f = art_copy / "decode_bf16.jaxexport"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0x5A
    f.write_bytes(bytes(data))
    _rehash(art_copy, "decode_bf16.jaxexport")
    _rejects(art_copy, capsys, "decode_bf16")


@pytest.mark.parametrize(
    "a, b",
    [
        ("prefill_fp32", "prefill_bf16"),
        ("decode_int8", "generate_int8"),
        ("generate_fp32", "generate_bf16"),
    ],
)
def test_swapped_artifacts_are_refused_by_name(art_copy, capsys, a, b):
    fa, fb = art_copy / f"{a}.jaxexport", art_copy / f"{b}.jaxexport"
    da, db = fa.read_bytes(), fb.read_bytes()
    fa.write_bytes(db)
    fb.write_bytes(da)
    _rehash(art_copy, fa.name, fb.name)
    err = _rejects(art_copy, capsys, "swapped or foreign artifact")
    assert a in err or b in err


def test_generate_loads_only_verified_artifacts(art_copy, verified_copy, capsys):
    rc, out, err = _generate(capsys, art_copy)  # exported but never verified
    assert (
        rc != 0
        and out == ""
        and err.strip()
        == f"error: artifacts {art_copy}: not verified (run: tpulab verify-export {art_copy})"
    )
    art, key = verified_copy
    rc, out, err = _generate(capsys, art)
    assert rc == 0 and out.startswith("To") and "verified (record)" in err, err
    rc, out2, err = _generate(capsys, art, "--key-file", str(key))
    assert rc == 0 and out2 == out and "verified (record+hmac)" in err, err


def test_forged_weights_with_forged_record(verified_copy, trained_run, capsys, tmp_path):
    """The threat model: without a key a rewritten record is accepted; the key or the checkpoint
    refuse it."""
    art, key = verified_copy
    name = _forge_weights(art)
    rc, _, err = _generate(capsys, art)  # the record no longer matches the manifest
    assert rc != 0 and "verification.json is for another manifest" in err, err
    from tpulab.checkpoint.files import sha256_file

    rec = json.loads((art / "verification.json").read_text())
    rec["manifest_sha256"] = sha256_file(
        art / "manifest.json"
    )  # half a forgery: the file hashes still old
    (art / "verification.json").write_text(json.dumps(rec))
    rc, _, err = _generate(capsys, art)
    assert rc != 0 and "does not record these files' sha256 (weights.npz" in err, err
    _forge_record(art)
    rc, _, err = _generate(capsys, art)
    assert rc == 0, (
        err
    )  # no key, no checkpoint: a consistent forgery passes (docs/inference.md says so)
    rc, _, err = _generate(capsys, art, "--key-file", str(key))
    assert rc != 0 and err.count("\n") == 1 and "not signed" in err, err
    rec = json.loads((art / "verification.json").read_text())
    rec["hmac_sha256"] = "0" * 64
    (art / "verification.json").write_text(json.dumps(rec))
    rc, _, err = _generate(capsys, art, "--key-file", str(key))
    assert rc != 0 and "signature does not match the key" in err, err
    rc, _, err = _generate(capsys, art, "--run-dir", str(trained_run))
    assert (
        rc != 0 and err.count("\n") == 1 and f"tensor {name} differs from checkpoint step 40" in err
    ), err
    bad_key = tmp_path / "short"
    bad_key.write_bytes(b"abc")
    rc, _, err = _generate(capsys, art, "--key-file", str(bad_key))
    assert rc != 0 and "at least 16" in err


def test_run_dir_reverification_and_model_identity(verified_copy, trained_run):
    from tpulab.inference.trust import load_verified

    art, key = verified_copy
    (art / "verification.json").unlink()  # not needed when the checkpoint itself is the reference
    got = load_verified(art, trained_run)
    assert got.verification["mode"] == "checkpoint" and got.verification["checkpoint_step"] == 40
    assert got.identity()["verification"]["weights"] == "bitwise equal to the checkpoint"
    with pytest.raises(TpulabError, match="not verified"):
        load_verified(art)


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["export", "--batch", "0"], "batch=0 must be an integer in [1, 256]"),
        (["export", "--batch", "257"], "batch=257"),
        (["serve", "--max-batch", "0"], "max_batch=0 must be in [1, 256]"),
        (["serve", "--max-batch", "100000"], "max_batch=100000"),
        (["serve", "--request-timeout", "nan"], "request_timeout=nan"),
        (["serve", "--max-queue", "0"], "max_queue=0"),
        (["serve", "--batch-window-ms", "inf"], "batch_window_ms=inf"),
    ],
)
def test_batch_and_service_bounds_are_one_line_errors(argv, reason, trained_run, tmp_path, capsys):
    from tpulab.cli.main import main

    where = (
        ["--run-dir", str(trained_run), "--out", str(tmp_path / "out")]
        if argv[0] == "export"
        else ["--artifacts", str(tmp_path / "none")]
    )
    rc = main([argv[0], *where, *argv[1:]])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and reason in err, err
    assert not (tmp_path / "out").exists()


# --- Signing needs a run dir the verifier names (issue 19 item 8) --------------------------------


@pytest.fixture(scope="module")
def forged(other_run, tmp_path_factory):
    """A forged pair: artifacts exported from a forged checkpoint (``other_run``), their manifest
    naming that run dir, every hash consistent."""
    from tpulab.inference.export import export_artifacts
    from tpulab.train.restore import load_model

    out = tmp_path_factory.mktemp("forged") / "art"
    export_artifacts(load_model(other_run), other_run, out)
    return out


def _listing(path):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()}


def test_signing_needs_a_run_dir_and_a_forged_pair_fails_against_the_true_run(
    forged, other_run, trained_run, tmp_path, capsys
):
    """Checked against the forged checkpoint its own manifest names, a forged set passes every
    comparison: signing that is refused, and against the true run the forged set fails."""
    from tpulab.cli.main import main
    from tpulab.train.restore import load_model

    art = tmp_path / "forged"
    shutil.copytree(forged, art)
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef-test-key")
    before = _listing(art)
    _rejects(art, capsys, "signing needs --run-dir", extra=("--key-file", str(key)))
    assert _listing(art) == before  # nothing written
    true_run = ("--run-dir", str(trained_run), "--key-file", str(key))
    _rejects(art, capsys, "the artifacts were exported from", extra=true_run)
    assert _listing(art) == before
    # Control: unsigned, without --run-dir, the forged pair passes; the record says its checkpoint
    # came from the set's own manifest (the forged run), not from the verifier.
    assert main(["verify-export", str(art)]) == 0
    out = capsys.readouterr().out
    rec = json.loads((art / "verification.json").read_text())
    assert "hmac_sha256" not in rec and rec["passed"]
    assert rec["checkpoint_source"]["given_by"] == "artifact manifest"
    assert rec["checkpoint_source"]["run_dir"] == str(other_run.resolve())
    assert rec["checkpoint_manifest_sha256"] == load_model(other_run).checkpoint_digest
    assert "(run dir given by the artifact manifest)" in out, out


def test_a_signed_record_names_the_checkpoint_the_verifier_gave(verified, trained_run):
    from tpulab.train.restore import load_model

    restored = load_model(trained_run)
    rec = json.loads((verified[0] / "verification.json").read_text())
    assert len(rec["hmac_sha256"]) == 64
    assert rec["checkpoint_source"] == {
        "run_dir": str(trained_run.resolve()),
        "given_by": "user",
        "checkpoint_dir": str(restored.checkpoint_dir.resolve()),
    }
    assert rec["checkpoint_manifest_sha256"] == restored.checkpoint_digest


def _hmac(record, key):
    """The record's HMAC computed here, independently of tpulab.inference.trust."""
    body = {k: v for k, v in record.items() if k != "hmac_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def test_a_record_signed_without_a_named_run_dir_is_refused(verified_copy, capsys):
    """A record signed before signing needed --run-dir may vouch for a forged checkpoint."""
    art, key = verified_copy
    rec = json.loads((art / "verification.json").read_text())
    assert rec["hmac_sha256"] == _hmac(rec, key.read_bytes())  # control: signed as trust signs
    rc, _, err = _generate(capsys, art, "--key-file", str(key))
    assert rc == 0, err
    for legacy in ("artifact manifest", None):
        if legacy is None:
            del rec["checkpoint_source"]  # a record from before the field existed
        else:
            rec["checkpoint_source"]["given_by"] = legacy
        rec["hmac_sha256"] = _hmac(rec, key.read_bytes())
        (art / "verification.json").write_text(json.dumps(rec))
        rc, out, err = _generate(capsys, art, "--key-file", str(key))
        assert rc != 0 and out == "" and err.count("\n") == 1, err
        assert "signed without a run dir named by the verifier" in err, err
