"""The registry end to end through the CLI on a real sqlite MLflow store: tags per the contract,
promotion refused on forged tags and on a behaviour regression, rollback, retire/delete refusals,
the ledger's tamper detection, moves made outside tpulab, bad stores. Every refusal is one line,
a non-zero exit, and leaves the store and the ledger byte for byte as they were."""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import sqlite3
import time

import pytest

from conftest import copy_registry_store, verified_export
from conftest import registry_cli as registry
from tpulab.errors import TpulabError
from tpulab.ops import tags as T

NAME = "tiny"


def refused(result, *words) -> str:
    rc, _, err = result
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _uri(store) -> str:
    return f"sqlite:///{store}/mlruns.db"


def _client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=_uri(store))


def fingerprint(store) -> tuple[str, str]:
    """sha256 of the sqlite file and of the ledger: what "nothing changed" means."""
    db = hashlib.sha256((store / "mlruns.db").read_bytes()).hexdigest()
    path = store / "registry_ledger.jsonl"
    return db, hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "-"


@pytest.fixture(scope="module")
def exports(trained_run, tmp_path_factory) -> dict:
    """Export sets of the run's step-20 and step-40 checkpoints (step 40 is the better model): the
    verified sets the serving modules share (read only; register re-verifies them against the
    checkpoint, so their verification record changes nothing here)."""
    return {step: verified_export(trained_run, tmp_path_factory, step) for step in (20, 40)}


@pytest.fixture(scope="module")
def flow(registry_flow):
    """A store where step 20 is v1, step 40 is v2, champion went v1 then v2; with each output
    (``conftest.registry_flow``: made once per pytest run, shared with test_serve_registry.py;
    read only)."""
    return registry_flow


@pytest.fixture
def store(flow, tmp_path):
    """A private copy of the flow's store and ledger (the artifacts stay shared: tests never
    touch them)."""
    return copy_registry_store(flow[0], tmp_path / "store")


def _tampered_copy(art, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(art, bad)
    data = bytearray((bad / "weights.npz").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "weights.npz").write_bytes(bytes(data))
    return bad


def test_register_refuses_tampered_artifacts_and_leaves_no_store(exports, tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    bad = _tampered_copy(exports[20], tmp_path)
    refused(
        registry(_uri(fresh), "register", "--artifacts", str(bad), "--name", NAME),
        "sha256 mismatch in weights.npz",
    )
    assert list(fresh.iterdir()) == []  # no store, no ledger, no lock file left behind


def test_versions_carry_the_contract_tags_and_the_ledger_chains(flow, exports, trained_run):
    from tpulab.checkpoint.files import sha256_file
    from tpulab.model.decode import Decoder
    from tpulab.ops.behaviour import evaluate
    from tpulab.train.restore import load_model

    store, outputs = flow
    c = _client(store)
    assert c.get_registered_model(NAME).aliases == {"champion": 2}
    corpus = json.loads((trained_run / "documents.json").read_text())["identity"]
    for version, step in ((1, 20), (2, 40)):
        mv = c.get_model_version(NAME, str(version))
        restored = load_model(trained_run, step)
        assert mv.source == mv.tags[T.ARTIFACTS] == str(exports[step].resolve())
        assert mv.tags[T.EXPORT_MANIFEST] == sha256_file(exports[step] / "manifest.json")
        assert mv.tags[T.CHECKPOINT] == restored.checkpoint_digest
        assert mv.tags[T.CORPUS] == corpus
        assert mv.tags[T.RUN_ID] == "" and mv.tags[T.RESUME_VERDICT] == "absent"
        assert T.RETIRED not in mv.tags
        got = {
            k[len(T.EVAL_PREFIX) :]: float(v)
            for k, v in mv.tags.items()
            if k.startswith(T.EVAL_PREFIX)
        }
        assert set(got) == {"held_out_loss", "stop_rate", "byte_validity", "exact_match"}
        if step == 40:  # what the registry logged is what the jitted model scores on the suite
            assert got == evaluate(Decoder.of(restored.model, "fp32"))["scores"]
    assert "baseline v1 (re-evaluated now)" in outputs[3] and "champion: v1 -> v2" in outputs[3]

    # The chain, recomputed here from the documented rule (sha256 of the sorted, compact JSON
    # without its own sha256; prev_sha256 of the line before; the first one's is 64 zeros).
    lines = (store / "registry_ledger.jsonl").read_text().splitlines()
    prev = "0" * 64
    for n, line in enumerate(lines, 1):
        e = json.loads(line)
        body = {k: v for k, v in e.items() if k != "sha256"}
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        assert e["sha256"] == hashlib.sha256(canon.encode()).hexdigest()
        assert e["prev_sha256"] == prev and e["seq"] == n
        assert {"user", "uid", "host"} <= set(e["who"]) and e["reason"]
        prev = e["sha256"]
    actions = [(json.loads(x)["action"], json.loads(x).get("from_version")) for x in lines]
    assert actions == [("register", None), ("register", None), ("promote", None), ("promote", "1")]
    assert json.loads(lines[0])["reason"] == "first cut"
    assert c.get_registered_model(NAME).tags[T.LEDGER_HEAD] == prev
    promoted = json.loads(lines[3])["evidence"]
    assert promoted["export_manifest_sha256"] == sha256_file(exports[40] / "manifest.json")
    assert promoted["verification"]["mode"] == "checkpoint"
    assert promoted["behaviour"]["baseline"]["version"] == "1"


def test_promotion_refused_on_regression_even_with_forged_scores(store):
    c, uri = _client(store), _uri(store)
    for k, v in (("held_out_loss", "0.5"), ("exact_match", "1.0"), ("stop_rate", "1.0")):
        c.set_model_version_tag(NAME, "1", T.EVAL_PREFIX + k, v)  # tags claim v1 is excellent
    before = fingerprint(store)
    line = refused(
        registry(uri, "promote", NAME, "1"), "refused by the behaviour gate against champion v2"
    )
    assert "held_out_loss 4.44" in line and "margin 0.05" in line  # re-evaluated, not read
    assert fingerprint(store) == before
    assert c.get_registered_model(NAME).aliases == {"champion": 2}


@pytest.mark.parametrize(
    "tag, words",
    [
        (T.EXPORT_MANIFEST, ("says ffffffffffff", "manifest on disk hashes to", "forged tag")),
        (T.CHECKPOINT, ("says ffffffffffff", "the manifest names checkpoint")),
        (T.CORPUS, ("says ffffffffffff", "the run's corpus is")),
        (T.RESUME_VERDICT, ("names a verdict file that is gone or changed",)),
    ],
)
def test_promotion_refused_on_a_forged_digest_tag(store, tmp_path, tag, words):
    c, uri = _client(store), _uri(store)
    value = "f" * 64
    if tag == T.RESUME_VERDICT:  # claims a passing proof that is not on disk as claimed
        (tmp_path / "verdict.json").write_text('{"identical": true}')
        value = json.dumps(
            {"identical": True, "verdict_sha256": "f" * 64, "path": str(tmp_path / "verdict.json")}
        )
    c.set_model_version_tag(NAME, "1", tag, value)
    before = fingerprint(store)
    refused(registry(uri, "promote", NAME, "1", "--to", "canary"), f"tag {tag}", *words)
    assert fingerprint(store) == before


def _verdict(**dirs) -> dict:
    """A kill/resume verdict.json as the proofs write it (the typed record, flat)."""
    from tpulab.checkpoint.rundir import ResumeVerdict

    shared = dict(kind="resume", identical=True, curves_identical=True, signal="SIGKILL")
    shared |= dict(final_state_identical=True, steps=4, steps_compared=4, max_abs_diff=0.0)
    shared |= dict(first_differing_step=None, missing_steps=[], kill_step=2, resumed_from_step=2)
    return ResumeVerdict(
        **{"reference_dir": "", "run_dir": "", "summary": "", **shared, **dirs}
    ).to_dict()


def test_resume_verdict_and_training_run_are_found_only_for_this_run(tmp_path):
    from tpulab.ops.registry_evidence import resume_verdict, training_run_id
    from tpulab.ops.registry_store import open_registry
    from tpulab.tracking.store import RUN_FILE

    run = tmp_path / "out" / "run"
    run.mkdir(parents=True)
    assert resume_verdict(run) == "absent"
    proof = tmp_path / "out" / "proof"
    proof.mkdir()
    (proof / "verdict.json").write_text(json.dumps(_verdict(reference_dir=str(run))))
    tag = json.loads(resume_verdict(run))
    assert tag["identical"] is True and tag["path"] == str(proof / "verdict.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_verdict(run_dir=str(tmp_path / "elsewhere"))))
    with pytest.raises(Exception, match="is about another run"):
        resume_verdict(run, other)
    # a verdict written before verdicts were typed (no kind, no summary): refused, in one line
    other.write_text(json.dumps({"identical": True, "reference_dir": str(run)}))
    with pytest.raises(TpulabError, match=r"missing \['.*'kind'.*\] \(written before"):
        resume_verdict(run, other)

    reg = open_registry(_uri(tmp_path), create=True)
    assert training_run_id(reg, run) == ""
    rid = reg.client.create_run(reg.experiment_id).info.run_id
    (run / RUN_FILE).write_text(json.dumps({"tracking_uri": reg.uri, "run_id": rid}))
    assert training_run_id(reg, run) == rid
    (run / RUN_FILE).write_text(json.dumps({"tracking_uri": "sqlite:////x/y.db", "run_id": rid}))
    assert training_run_id(reg, run) == ""  # a run in another store is not this store's run


def test_rollback_moves_champion_back_once(store):
    uri = _uri(store)
    rc, out, err = registry(uri, "rollback", NAME, "--reason", "v2 misbehaves")
    assert rc == 0, err
    assert "champion: v2 -> v1" in out and "verified tiny v1" in out
    assert _client(store).get_registered_model(NAME).aliases == {"champion": 1}
    entry = json.loads((store / "registry_ledger.jsonl").read_text().splitlines()[-1])
    assert (entry["action"], entry["version"], entry["from_version"]) == ("rollback", "1", "2")
    assert entry["reason"] == "v2 misbehaves" and entry["evidence"]["checkpoint_step"] == 20
    before = fingerprint(store)  # v1 was the first champion: nothing earlier to go back to
    refused(registry(uri, "rollback", NAME), "no earlier promoted version of tiny")
    assert fingerprint(store) == before
    rc, out, _ = registry(uri, "status", NAME)
    assert (
        rc == 0 and "champion -> v1" in out and "rollback champion: v2 -> v1: v2 misbehaves" in out
    )


def _repoint(store, version: str, root) -> None:
    """Point a version's source (and its ARTIFACTS tag) at ``root``: the artifacts it was
    registered with, copied, so that the shared export sets are never touched."""
    db = sqlite3.connect(store / "mlruns.db")
    with db:
        db.execute("UPDATE model_versions SET source = ? WHERE version = ?", (str(root), version))
    db.close()
    _client(store).set_model_version_tag(NAME, version, T.ARTIFACTS, str(root))


def test_rollback_refuses_a_target_that_fails_reverification(store, exports, tmp_path):
    """champion v2 -> v1, where v1's artifacts had one weight byte flipped after registration
    (its manifest, and so every tag, unchanged): one line, a non-zero exit, the alias and the
    ledger as they were. Control: the same move to an untampered copy rolls back."""
    from tpulab.errors import ExitCode

    c, uri, path = _client(store), _uri(store), store / "registry_ledger.jsonl"
    _repoint(store, "1", _tampered_copy(exports[20], tmp_path))
    before, ledger_before = fingerprint(store), path.read_text()
    rc, _, err = registry(uri, "rollback", NAME)
    line = refused((rc, "", err), "sha256 mismatch in weights.npz")
    assert rc == ExitCode.BAD_INPUT, (rc, line)
    assert fingerprint(store) == before and path.read_text() == ledger_before
    assert c.get_registered_model(NAME).aliases == {"champion": 2}
    assert json.loads(ledger_before.splitlines()[-1])["action"] == "promote"

    intact = tmp_path / "intact"
    shutil.copytree(exports[20], intact)
    _repoint(store, "1", intact)
    rc, out, err = registry(uri, "rollback", NAME)
    assert rc == ExitCode.OK and "champion: v2 -> v1" in out, err
    assert c.get_registered_model(NAME).aliases == {"champion": 1}
    entry = json.loads(path.read_text().splitlines()[-1])
    assert (entry["action"], entry["version"], entry["from_version"]) == ("rollback", "1", "2")
    assert entry["evidence"]["artifacts"] == str(intact)


def test_retire_and_delete_refuse_the_aliased_version(store):
    c, uri = _client(store), _uri(store)
    before = fingerprint(store)
    refused(registry(uri, "retire", NAME, "2"), "v2 holds alias champion", "nothing changed")
    refused(registry(uri, "delete", NAME, "2"), "v2 holds alias champion")
    refused(registry(uri, "promote", NAME, "7"), "has no version 7")
    refused(registry(uri, "promote", "nobody", "1"), "no model nobody")
    refused(registry(uri, "promote", NAME, "2"), "already holds champion")
    assert fingerprint(store) == before

    rc, out, err = registry(uri, "retire", NAME, "1")
    assert rc == 0 and "retired tiny v1" in out, err
    assert c.get_model_version(NAME, "1").tags[T.RETIRED] == "true"
    refused(registry(uri, "promote", NAME, "1", "--to", "canary"), "v1 is retired")
    # champion's history is [v1, v2]; v1 is retired, so there is nowhere to roll back to.
    refused(registry(uri, "rollback", NAME), "no earlier promoted version", "skipped v1 (retired)")
    rc, _, err = registry(uri, "delete", NAME, "1")
    assert rc == 0, err
    assert [int(v.version) for v in c.search_model_versions(f"name = '{NAME}'")] == [2]
    rc, out, _ = registry(uri, "status", NAME)
    assert rc == 0 and "retire v1" in out and "delete v1" in out and "champion -> v2" in out


def test_an_edited_removed_or_reordered_ledger_entry_refuses_everything(store):
    uri, path = _uri(store), store / "registry_ledger.jsonl"
    good = path.read_bytes()
    lines = good.decode().splitlines(keepends=True)
    assert registry(uri, "status", NAME)[0] == 0  # the untouched copy passes
    tampered = {
        "edited": lines[:2] + [lines[2].replace("first champion", "first chamption")] + lines[3:],
        "removed": lines[:3],
        "dropped": lines[:1] + lines[2:],
        "reordered": [lines[1], lines[0], *lines[2:]],
    }
    words = {
        "edited": "line 3: the entry does not hash to its sha256 (it was edited)",
        "removed": "does not end where the store says",
        "dropped": "line 2: prev_sha256 does not match",
        "reordered": "line 1: prev_sha256 does not match",
    }
    for kind, text in tampered.items():
        path.write_text("".join(text))
        before = fingerprint(store)
        refused(registry(uri, "status", NAME), words[kind])
        refused(registry(uri, "rollback", NAME), words[kind])
        refused(registry(uri, "retire", NAME, "1"), words[kind])
        assert fingerprint(store) == before, kind
    path.unlink()
    refused(registry(uri, "status", NAME), "does not end where the store says")
    path.write_bytes(good)
    assert registry(uri, "status", NAME)[0] == 0


def test_moves_made_outside_tpulab_are_reported(store):
    c, uri = _client(store), _uri(store)
    c.set_registered_model_alias(NAME, "champion", "1")  # behind the ledger's back
    rc, _, err = registry(uri, "status", NAME)
    assert (
        rc == 1
        and "alias champion is on v1 in the store, the ledger's last move put it on v2" in err
    )
    c.set_registered_model_alias(NAME, "champion", "2")
    assert registry(uri, "status", NAME)[0] == 0
    c.delete_model_version(NAME, "2")  # MLflow drops the alias with the version, silently
    assert c.get_registered_model(NAME).aliases == {}
    rc, _, err = registry(uri, "status", NAME)
    assert rc == 1 and "alias champion is on no version in the store" in err


def test_a_change_made_while_a_command_verified_refuses_its_commit(store):
    from tpulab.ops.registry_check import consistent_ledger, unchanged_since
    from tpulab.ops.registry_store import open_registry

    reg = open_registry(_uri(store))
    entries, _, model = consistent_ledger(reg, NAME)
    mv = reg.client.get_model_version(NAME, "1")
    unchanged_since(reg, NAME, entries, model, mv)  # nothing happened: no refusal
    reg.client.set_model_version_tag(NAME, "1", T.RETIRED, "true")  # e.g. retired meanwhile
    with pytest.raises(Exception, match="changed while this command verified it"):
        unchanged_since(reg, NAME, entries, model, mv)
    reg.client.delete_model_version_tag(NAME, "1", T.RETIRED)
    reg.client.set_registered_model_alias(NAME, "canary", "1")
    with pytest.raises(Exception, match="changed while this command verified it"):
        unchanged_since(reg, NAME, entries, model)


def test_bad_stores_are_refused_in_one_line(store, tmp_path):
    uri = _uri(store)
    refused(registry(_uri(tmp_path / "none"), "status", NAME), "no registry store at")
    refused(registry("http://127.0.0.1:9/", "status", NAME), "needs a sqlite MLflow store")
    refused(registry(uri, "promote", NAME, "1", "--to", "v3"), "reserved by MLflow")
    refused(registry(uri, "status", "bad name"), "model name 'bad name' must be")

    holder = sqlite3.connect(store / "mlruns.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing the store
    try:
        before = fingerprint(store)
        refused(
            registry(uri, "retire", NAME, "1"),
            "is locked by another process",
            "nothing was changed",
        )
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert fingerprint(store) == before
    with open(store / "registry_ledger.lock", "a") as f:  # another registry command running
        fcntl.flock(f, fcntl.LOCK_EX)
        refused(registry(uri, "retire", NAME, "1"), "locked by another tpulab registry command")
    assert fingerprint(store) == before

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "mlruns.db").write_bytes(b"not sqlite " * 200)
    data = (corrupt / "mlruns.db").read_bytes()
    refused(registry(_uri(corrupt), "status", NAME), "is not a readable sqlite database")
    refused(registry(_uri(corrupt), "rollback", NAME), "is not a readable sqlite database")
    assert (corrupt / "mlruns.db").read_bytes() == data


def test_promote_refuses_artifacts_changed_after_registration(store, exports, tmp_path):
    # The version's source re-pointed at a copy with one weight byte flipped; manifest.json is
    # untouched, so the digest tag still matches and only the rehash of every file can tell.
    _repoint(store, "1", _tampered_copy(exports[20], tmp_path))
    before = fingerprint(store)
    refused(
        registry(_uri(store), "promote", NAME, "1", "--to", "canary"),
        "sha256 mismatch in weights.npz",
    )
    assert fingerprint(store) == before


def test_the_cli_process_prints_one_line_and_no_mlflow_chatter(store, tmp_path):
    from conftest import run_cli

    ok = run_cli("registry", "status", NAME, "--tracking-uri", _uri(store), timeout=120)
    assert ok.returncode == 0 and ok.stderr == "" and "champion -> v2" in ok.stdout, ok.stderr
    (tmp_path / "mlruns.db").write_bytes(b"\0" * 4096)
    bad = run_cli("registry", "status", NAME, "--tracking-uri", _uri(tmp_path), timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()], bad.stderr


def test_prompts_are_versioned_by_content_hash(tmp_path):
    from tpulab.ops.prompts import PromptResolver, load_prompt, prompt_sha256
    from tpulab.ops.registry_store import open_registry

    uri = _uri(tmp_path)
    open_registry(uri, create=True)
    rc, out, err = registry(uri, "prompt", "speaker", "--template", "{{ speaker }}.\n")
    assert rc == 0 and "prompts:/speaker/1" in out and "new version" in out, err
    rc, out, _ = registry(uri, "prompt", "speaker", "--template", "{{ speaker }}.\n")
    assert "prompts:/speaker/1" in out and "same text as before" in out
    registry(uri, "prompt", "speaker", "--template", "{{ speaker }}:\n")
    rc, out, _ = registry(uri, "prompt", "speaker")
    assert out.count("prompts:/speaker/") == 2 and prompt_sha256("{{ speaker }}:\n") in out

    reg = open_registry(uri)
    p = load_prompt(reg, "speaker", 1)
    assert p.sha256 == prompt_sha256("{{ speaker }}.\n") and p.render(speaker="ROMEO") == "ROMEO.\n"
    with pytest.raises(Exception, match="needs speaker"):
        p.render()
    # The stored template edited in the database: its hash no longer matches its tag.
    db = sqlite3.connect(tmp_path / "mlruns.db")
    with db:
        n = db.execute(
            "UPDATE model_version_tags SET value = 'KING.\n' WHERE name = 'speaker' AND "
            "version = 1 AND key = 'mlflow.prompt.text'"
        ).rowcount
    db.close()
    assert n == 1
    refused(registry(uri, "prompt", "speaker"), "the template hashes to", "edited in the store")
    with pytest.raises(Exception, match="the template hashes to"):  # a service refuses it too
        PromptResolver(reg, 1.0)("speaker/1", "KING.\n")


def test_a_prompt_version_resolves_to_what_the_registry_holds(tmp_path):
    """A service's ``prompt_version`` on a real prompt registry: a version or an alias becomes the
    stored version (an alias read again after its TTL), the prompt must be that template rendered;
    unknown names, versions and aliases, and other texts, are refused (one line)."""
    from tpulab.errors import TpulabError
    from tpulab.ops.prompts import PromptResolver, prompt_sha256, rendered_from
    from tpulab.ops.registry_store import open_registry

    uri = _uri(tmp_path)
    open_registry(uri, create=True)
    for template in ("{{ speaker }}.\n", "{{ speaker }}:\n"):
        assert registry(uri, "prompt", "speaker", "--template", template)[0] == 0
    reg = open_registry(uri)
    reg.client.set_prompt_alias("speaker", "prod", 2)
    now = [0.0]
    resolve = PromptResolver(reg, 10.0, clock=lambda: now[0])
    got = resolve("prompts:/speaker/1", "ROMEO.\n")
    assert got == {
        "prompt_version": "prompts:/speaker/1",
        "prompt_label": "prompts:/speaker/1",
        "prompt_template_sha256": prompt_sha256("{{ speaker }}.\n"),
        "prompt_resolved": True,
    }
    assert resolve("speaker/2", "ROMEO:\n")["prompt_version"] == "prompts:/speaker/2"
    assert resolve("speaker@prod", "ROMEO:\n")["prompt_version"] == "prompts:/speaker/2"
    reg.client.set_prompt_alias("speaker", "prod", 1)
    now[0] = 9.0  # within the TTL the alias is not read again; past it, it is
    assert resolve("speaker@prod", "ROMEO:\n")["prompt_version"] == "prompts:/speaker/2"
    now[0] = 10.5
    assert resolve("speaker@prod", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"
    for label, text, words in (
        ("speaker/9", "ROMEO.\n", "no prompt speaker version 9 in the registry"),
        ("nobody/1", "ROMEO.\n", "no prompt nobody version 1"),
        ("speaker@staging", "ROMEO.\n", "no prompt speaker alias staging"),
        ("speaker", "ROMEO.\n", "is not prompts:/NAME/VERSION or prompts:/NAME@ALIAS"),
        ("speaker/1", "ROMEO:\n", "the prompt is not prompts:/speaker/1 rendered"),
        ("speaker/1", "ROMEO.\nextra", "the prompt is not prompts:/speaker/1 rendered"),
    ):
        with pytest.raises(TpulabError, match=re.escape(words)) as e:
            resolve(label, text)
        assert "\n" not in str(e.value)
    # A version is read again after the TTL too: deleted, or its template edited in the store (the
    # sqlite row MLflow keeps it in), it is refused within one TTL, served until then.
    import sqlite3

    for template in ("{{ speaker }}!\n", "{{ speaker }}?\n"):
        assert registry(uri, "prompt", "speaker", "--template", template)[0] == 0
    assert resolve("speaker/3", "ROMEO!\n")["prompt_version"] == "prompts:/speaker/3"
    assert resolve("speaker/4", "ROMEO?\n")["prompt_version"] == "prompts:/speaker/4"
    reg.client.delete_prompt_version("speaker", "3")
    with sqlite3.connect(tmp_path / "mlruns.db") as db:
        edited = db.execute(
            "UPDATE model_version_tags SET value = ? WHERE name = 'speaker' AND version = 4 "
            "AND key = 'mlflow.prompt.text'",
            ("{{ speaker }}?!\n",),
        ).rowcount
    assert edited == 1
    now[0] = 20.0  # still within the TTL of step 10.5: the cached answers stand
    assert resolve("speaker/3", "ROMEO!\n")["prompt_version"] == "prompts:/speaker/3"
    assert resolve("speaker/4", "ROMEO?\n")["prompt_version"] == "prompts:/speaker/4"
    now[0] = 21.0
    for label, words in (("speaker/3", "no prompt speaker version 3"), ("speaker/4", "hashes to")):
        with pytest.raises(TpulabError, match=re.escape(words)):
            resolve(label, "ROMEO!\n" if label.endswith("3") else "ROMEO?\n")
    assert resolve("speaker/1", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"  # re-read
    # A store that cannot be read is the service's 503, not the client's 422: PromptStoreError,
    # not TpulabError; a version resolved before stays served from the cache, past its TTL too
    # (only a deletion, refused once the store reads again, could have changed it), an alias not
    import shutil

    from tpulab.ops.prompts import PromptStoreError

    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tmp_path / "mlruns.db", broken / "mlruns.db")
    on_broken = PromptResolver(open_registry(_uri(broken)), 10.0, clock=lambda: now[0])
    assert on_broken("speaker/1", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"
    assert on_broken("speaker@prod", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"
    (broken / "mlruns.db").write_bytes(b"not a database " * 512)
    with pytest.raises(PromptStoreError, match="prompt registry .*mlruns.db") as e:
        on_broken("speaker/2", "ROMEO:\n")
    assert not isinstance(e.value, TpulabError) and "\n" not in str(e.value)
    assert on_broken("speaker/1", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"
    now[0] = 60.0
    assert on_broken("speaker/1", "ROMEO.\n")["prompt_version"] == "prompts:/speaker/1"
    with pytest.raises(PromptStoreError):
        on_broken("speaker@prod", "ROMEO.\n")
    assert rendered_from("A {{ x }} B {{ y }} C", "A 1 B 2 B C") and rendered_from("ab", "ab")
    assert not rendered_from("A {{ x }} B {{ y }} C", "A 1 C") and not rendered_from("ab", "abc")
    # Linear: the regex (.*?)Y(.*?)Y(.*?)Q(.*?)X backtracks through ~n^3/6 splits of this text.
    t0 = time.perf_counter()
    assert not rendered_from("{{ a }}Y{{ b }}Y{{ c }}Q{{ d }}X", "Y" * 4000 + "X")
    assert time.perf_counter() - t0 < 0.5
