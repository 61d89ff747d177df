"""The run directory's one interface: typed paths, the one JSON reader, and no name outside it."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from conftest import REPO, tiny_config
from tpulab.checkpoint import files
from tpulab.checkpoint import rundir as R
from tpulab.checkpoint.rundir import RunDir, read_json, write_config, write_json

SRC = REPO / "src" / "tpulab"
HOME = SRC / "checkpoint" / "rundir.py"
# The manifest's name is defined beside the code that writes and verifies a checkpoint; rundir.py
# re-exports it (files.py cannot import rundir.py back: an import cycle).
MANIFEST_HOME = SRC / "checkpoint" / "files.py"

# File names: flagged anywhere in a string (f-string holes read as "{}"), docstrings excepted.
FILE_NAMES = re.compile(
    r"(?<![\w.-])(?:config\.yaml|env\.json|documents\.json|metrics\.jsonl|summary\.json"
    r"|goodput\.json|audits\.json|mlflow_run\.json|tpulab_manifest\.json|verdict\.json"
    r"|windows\.p(?:\*|\{\}|\d+)\.jsonl)(?![\w.-])"
)
# Directory names are common words ("reference" is a dict key in five modules): flagged as a path
# component inside a string, as the right side of ``/``, or as the value of an assignment.
DIR_NAMES = ("checkpoints", "rejected_checkpoints", "proof", "chaos", "reference", "interrupted")
DIR_NAMES += ("victim",)
_DIRS = "|".join(DIR_NAMES)
DIR_IN_STRING = re.compile(rf"/(?:{_DIRS})(?:/|$)|^(?:{_DIRS})/")  # a slash makes it a path

# Files allowed to hold run-dir literals, with how many. Empty: every site is converted. It stays
# so a file caught mid-conversion can be listed with its count; the stale check keeps it shrinking.
PENDING: dict[str, int] = {}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def literal_sites(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every run-dir name written as a literal in ``source``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    exact = set()  # dir names standing alone where they make a path: `x / "proof"`, `D = "proof"`
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            exact.add(id(n.right))
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            exact.add(id(n.value))
    sites = []
    for n in ast.walk(tree):
        text = _text(n)
        if text is None or id(n) in docs or id(n) in inner:
            continue
        found = FILE_NAMES.findall(text) + DIR_IN_STRING.findall(text)
        if id(n) in exact and text in DIR_NAMES:
            found.append(text)
        sites += [(n.lineno, f) for f in found]
    return sorted(set(sites))


def _scan() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == HOME:
            continue
        sites = literal_sites(path.read_text())
        if path == MANIFEST_HOME:
            sites = [s for s in sites if s != (_line_of(path, "MANIFEST = "), files.MANIFEST)]
        if sites:
            out[str(path.relative_to(SRC))] = sites
    return out


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def check_literals(found: dict[str, list], pending: dict[str, int]) -> list[str]:
    bad = []
    for rel, sites in sorted(found.items()):
        allowed = pending.get(rel, 0)
        if len(sites) > allowed:
            where = ", ".join(f"{line}: {lit!r}" for line, lit in sites)
            bad.append(f"{rel} has {len(sites)} run-dir literal(s) (allowed {allowed}): {where}")
    return bad


def test_no_run_dir_literals_outside_rundir():
    bad = check_literals(_scan(), PENDING)
    assert not bad, "use tpulab.checkpoint.rundir instead:\n" + "\n".join(bad)


def test_pending_lists_only_files_that_still_need_it():
    """An entry whose file went clean (or below its count) is stale: the allow-list only shrinks."""
    found = _scan()
    stale = {rel: n for rel, n in PENDING.items() if len(found.get(rel, [])) < n}
    assert not stale, f"lower or drop these PENDING entries: {stale}"


def test_the_literal_check_can_fail():
    """Negative control: each kind of literal is seen, docstrings and dict keys are not."""
    source = '''
"""Writes config.yaml and checkpoints/ (a docstring: allowed)."""
A = run / "checkpoints"
B = run / "proof" / "verdict.json"
C = f"windows.p{i}.jsonl"
D = "metrics.jsonl"
E = {"reference": 1, "checkpoints": []}["reference"]
F = "see out/chaos/victim for the run"
G = "cloud_config.yaml"
H = "rejected_checkpoints"
'''
    got = literal_sites(source)
    assert got == [
        (3, "checkpoints"),
        (4, "proof"),
        (4, "verdict.json"),
        (5, "windows.p{}.jsonl"),
        (6, "metrics.jsonl"),
        (8, "/chaos/"),
        (10, "rejected_checkpoints"),
    ], got
    assert check_literals({"x.py": got}, {"x.py": len(got)}) == []
    assert check_literals({"x.py": got}, {"x.py": len(got) - 1}), "a grown count must fail"
    assert check_literals({"y.py": got[:1]}, {"x.py": 7}), "a file not in PENDING must fail"


def test_paths_are_the_names_the_layers_used(tmp_path):
    run = RunDir(tmp_path)
    assert run.config == tmp_path / "config.yaml"
    assert run.env == tmp_path / "env.json"
    assert run.documents == tmp_path / "documents.json"
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert run.summary == tmp_path / "summary.json"
    assert run.goodput == tmp_path / "goodput.json"
    assert run.mlflow_run == tmp_path / "mlflow_run.json"
    assert run.windows(3) == tmp_path / "windows.p3.jsonl"
    assert run.checkpoints == tmp_path / "checkpoints"
    assert run.rejected_checkpoints == tmp_path / "rejected_checkpoints"
    assert run.manifest(20) == tmp_path / "checkpoints" / "20" / "tpulab_manifest.json"
    assert R.MANIFEST is files.MANIFEST
    proof = run.proof
    assert isinstance(proof, RunDir) and proof.root == tmp_path / "proof"
    assert proof.interrupted.checkpoints == tmp_path / "proof" / "interrupted" / "checkpoints"
    assert proof.reference.metrics == tmp_path / "proof" / "reference" / "metrics.jsonl"
    assert proof.verdict == tmp_path / "proof" / "verdict.json"
    assert run.chaos.victim.root == tmp_path / "chaos" / "victim"
    assert run.chaos.verdict == tmp_path / "chaos" / "verdict.json"
    # a RunDir goes where a path goes, and reads the same in messages
    assert Path(run) == tmp_path and os.fspath(run) == str(tmp_path) and f"{run}" == str(tmp_path)
    assert RunDir(str(tmp_path)) == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.root = tmp_path / "other"


def test_window_files_are_every_process_ledger_in_order(tmp_path):
    run = RunDir(tmp_path)
    for i in (1, 0, 10):
        run.windows(i).write_text("")
    (tmp_path / "windows.json").write_text("")  # not a ledger
    assert [p.name for p in run.window_files()] == [
        "windows.p0.jsonl",
        "windows.p1.jsonl",
        "windows.p10.jsonl",
    ]


def test_read_json_reads_defaults_and_refuses(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"a": [1, 2]})
    assert read_json(path) == {"a": [1, 2]}
    assert json.loads(path.read_text()) == {"a": [1, 2]}  # the same bytes any reader sees
    assert not list(tmp_path.glob(".*tmp*")), "the atomic write leaves no temp file"
    assert read_json(tmp_path / "absent.json", None) is None
    assert read_json(tmp_path / "absent.json", {}) == {}
    with pytest.raises(FileNotFoundError):  # negative control: no default, no silent None
        read_json(tmp_path / "absent.json")
    path.write_text('{"a": ')
    with pytest.raises(ValueError):  # a torn record is never read as missing
        read_json(path, None)


def test_run_dir_records_round_trip(tmp_path):
    run = RunDir(tmp_path)
    assert run.write(R.VERDICT, {"passed": True}) == run.verdict
    assert run.read(R.VERDICT) == {"passed": True}
    assert run.read(R.SUMMARY, None) is None
    with pytest.raises(FileNotFoundError):
        run.read(R.SUMMARY)


def test_written_config_loads_back_as_the_same_config(tmp_path):
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    config = tiny_config("train.steps=7")
    path = RunDir(tmp_path).write_config(config)
    assert path == tmp_path / "config.yaml"
    assert load(RunConfig, path) == config
    other = tiny_config("train.steps=8")  # negative control: a different config reads different
    assert load(RunConfig, write_config(tmp_path / "o.yaml", other)) != config


def test_a_run_summary_reads_back_what_the_loop_wrote_and_refuses_other_records(tmp_path):
    """summary.json is one typed record (``RunSummary``) from the loop to the CLI, the tracking
    writer and the reports; a file that is not one is a one-line refusal, never a KeyError."""
    from tpulab.checkpoint.rundir import RunSummary

    run = RunDir(tmp_path)
    s = RunSummary(final_step=7, latest_checkpoint=5, final_loss=1.5, identities={"base": "ab"})
    run.write(R.SUMMARY, s.to_dict())
    assert run.read_summary() == s and run.read_summary().identities == {"base": "ab"}
    for bad, words in (
        ({**s.to_dict(), "final_stp": 7}, "unknown ['final_stp']"),
        ({"final_step": 7}, "missing ['latest_checkpoint']"),
        ([7], "a JSON list"),
    ):
        refused(run, R.SUMMARY, bad, run.read_summary, words)


def refused(run: RunDir, name: str, record, read, words: str) -> None:
    """``record`` written as ``name`` in ``run``: ``read()`` refuses it in one line that names the
    file and says ``words``."""
    from tpulab.errors import TpulabError

    run.write(name, record)
    with pytest.raises(TpulabError, match=re.escape(words)) as e:
        read()
    assert str(run.root / name) in str(e.value) and "\n" not in str(e.value)


def _verdict(**over) -> dict:
    """A flat verdict.json as proofs.driver.prove_resume writes it (judge's fields, the state's,
    the driver's own)."""
    return {
        "kind": "resume",
        "identical": True,
        "curves_identical": True,
        "final_state_identical": True,
        "signal": "SIGKILL",
        "steps": 10,
        "steps_compared": 12,
        "max_abs_diff": 0.0,
        "first_differing_step": None,
        "missing_steps": [],
        "kill_step": 7,
        "resumed_from_step": 5,
        "reference_dir": "/r/reference",
        "run_dir": "/r/interrupted",
        "summary": "per-step losses bitwise identical over 12 steps; final state bitwise identical",
        "steps_redone": 2,
        "first_differing_leaf": None,
        "checkpoints_at_kill": ["5"],
        **over,
    }


def test_a_resume_verdict_reads_back_typed_and_refuses_other_records(tmp_path):
    """verdict.json is one typed record (``ResumeVerdict``) from the four proof writers to the CLI,
    reports, chain and registry: the shared fields as attributes, the writer's own in ``details``
    (flat beside them on disk); a file that is not one is a one-line refusal."""
    from tpulab.checkpoint.rundir import ResumeVerdict

    proof = RunDir(tmp_path).proof
    proof.root.mkdir()
    v = ResumeVerdict.from_dict(_verdict())
    assert proof.write_verdict(v) == proof.verdict
    back = proof.read_verdict()
    assert back == v and back.kill_step == 7 and back.details["steps_redone"] == 2
    assert json.loads(proof.verdict.read_text()) == _verdict()  # flat on disk, nothing lost
    # a field the chaos writer writes and the one-kill proof does not: read under its kind
    chaos = {k: x for k, x in _verdict(kind="chaos", kill_log=[]).items() if k != "steps_redone"}
    chaos.pop("checkpoints_at_kill")
    assert ResumeVerdict.from_dict(chaos).details == {"kill_log": [], "first_differing_leaf": None}
    older = {k: x for k, x in _verdict().items() if k not in ("kind", "summary")}
    for bad, words in (
        (older, "missing ['kind', 'summary'] (written before verdicts were typed"),
        (_verdict(kill_log=[]), "a 'resume' verdict with unknown fields ['kill_log']"),
        (_verdict(kind="lottery"), "unknown kind 'lottery'"),
        (_verdict(identical="true", kill_step=True), "wrong types: identical='true', kill_step"),
        ([7], "a JSON list"),
    ):
        refused(proof, R.VERDICT, bad, proof.read_verdict, words)


def test_a_run_env_reads_back_what_the_loop_wrote_and_refuses_other_records(trained_run, tmp_path):
    """env.json is one typed record (``RunEnv``) from the loop to the reports, the capstone and the
    benchmarks: the shared facts as attributes, an objective's own (``Objective.describe``) in
    ``details``; a file that is not one is a one-line refusal, never a KeyError."""
    from tpulab.checkpoint.rundir import RunEnv

    on_disk = json.loads(RunDir(trained_run).env.read_text())
    env = RunDir(trained_run).read_env()  # the loop's own file, not one this test wrote
    assert env.backend == "cpu" and env.is_tpu is False and env.packages["jax"]
    # the objective's run_facts: tokens are the unit of work, batch x seq_len of them a step
    work = {"unit": "tokens", "per_step": 8 * 32}
    assert env.objective == "pretrain" and env.details == {"work": work}
    assert env.to_dict() == on_disk
    run = RunDir(tmp_path)
    lora = {**on_disk, "lora": {"rank": 4}}  # an objective's own facts: read, not refused
    assert run.write_env(RunEnv.from_dict(lora)) == run.env
    assert run.read_env().details == {"work": work, "lora": {"rank": 4}} and run.read(R.ENV) == lora
    gone = {k: v for k, v in on_disk.items() if k not in ("backend", "shapes")}
    for bad, words in (
        (gone, "missing ['backend', 'shapes']"),
        ({**on_disk, "device_count": "1", "is_tpu": 0}, "wrong types: device_count='1', is_tpu=0"),
        ({**on_disk, "device_kinds": [1]}, "wrong types: device_kinds=[1]"),
        ([7], "a JSON list"),
    ):
        refused(run, R.ENV, bad, run.read_env, words)


def test_a_run_env_records_the_libtpu_placeholders_as_the_receipt_does(trained_run, monkeypatch):
    """env.json lists the libtpu variables tpulab set off a TPU, read from ``libtpu_env`` (the one
    place that knows them) as the receipt reads them: a reader tells them from the user's own."""
    import importlib.util

    from tpulab import libtpu_env
    from tpulab.checkpoint.rundir import RunEnv
    from tpulab.errors import TpulabError
    from tpulab.evidence import provenance, receipt

    assert provenance.placeholders is libtpu_env.placeholders is receipt.placeholders
    env = RunDir(trained_run).read_env()  # the loop's own file
    assert env.tpulab_placeholders == sorted(libtpu_env.placeholders())
    if importlib.util.find_spec("libtpu") is not None and not libtpu_env.host_has_tpu():
        assert "ALLOW_MULTIPLE_LIBTPU_LOAD" in env.tpulab_placeholders  # conftest quieted libtpu
    # control: a name set on purpose is the user's, no longer listed; none set, none listed
    monkeypatch.setenv(libtpu_env.MARKER, "JAX_PLATFORMS,TPU_WORKER_ID")
    mine = libtpu_env.set_explicitly(dict(os.environ), {"JAX_PLATFORMS": "cpu"})
    monkeypatch.setenv(libtpu_env.MARKER, mine[libtpu_env.MARKER])
    assert provenance.environment(with_jax=False)["tpulab_placeholders"] == ["TPU_WORKER_ID"]
    monkeypatch.delenv(libtpu_env.MARKER)
    assert provenance.environment(with_jax=False)["tpulab_placeholders"] == []
    on_disk = json.loads(RunDir(trained_run).env.read_text())
    with pytest.raises(TpulabError, match=r"missing \['tpulab_placeholders'\]"):
        RunEnv.from_dict({k: v for k, v in on_disk.items() if k != "tpulab_placeholders"})
    with pytest.raises(TpulabError, match=r"wrong types: tpulab_placeholders=\[1\]"):
        RunEnv.from_dict({**on_disk, "tpulab_placeholders": [1]})


def _reshard(**over) -> dict:
    """verdict.json as proofs.scaleout.prove_reshard writes it."""
    return {
        "kind": "reshard",
        "passed": True,
        "identical": False,  # another layout sums in another order: within rtol, not bitwise
        "kill_step": 10,
        "resumed_from_step": 10,
        "max_abs_diff": 2.4e-7,
        "steps_compared": 2,
        "continued_vs_reference": {"steps": 2, "bitwise": False, "within_tolerance": True},
        "rtol": 1e-4,
        "reshard": {"leaves": 46, "bitwise_equal": True, "from": "2 proc", "to": "1 proc"},
        **over,
    }


def test_a_reshard_verdict_is_its_own_record_and_no_resume_verdict(tmp_path):
    """The reshard proof's verdict.json is typed (``ReshardVerdict``), every field its own; a
    reader of resume verdicts refuses it rather than read ``identical`` (False: not bitwise, by
    design) as its outcome, and a resume verdict is no reshard verdict either."""
    from tpulab.checkpoint.rundir import ReshardVerdict
    from tpulab.errors import TpulabError

    run = RunDir(tmp_path)
    v = ReshardVerdict.from_dict(_reshard())
    assert run.write_verdict(v) == run.verdict and run.read(R.VERDICT) == _reshard()

    def read():
        return ReshardVerdict.from_dict(run.read(R.VERDICT), str(run.verdict))

    back = read()
    assert back == v and back.passed and back.reshard["leaves"] == 46
    with pytest.raises(TpulabError, match=r"is not a resume verdict: missing \['curves_identical'"):
        run.read_verdict()
    for bad, words in (
        (_verdict(), "missing ['continued_vs_reference', 'passed', 'reshard', 'rtol'], unknown"),
        (_reshard(kind="resume"), "a reshard verdict of kind 'resume'"),
        (_reshard(passed="yes", kill_step=10.0), "wrong types: passed='yes', kill_step=10.0"),
        ({**_reshard(), "seed": 0}, "missing nothing, unknown ['seed']"),
        ([7], "a JSON list"),
    ):
        refused(run, R.VERDICT, bad, read, words)
