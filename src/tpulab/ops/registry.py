"""The model registry: MLflow Model Registry versions on the project's own store, moved by evidence.

``register`` makes a version of an export set verified against its checkpoint here as
``verify-export`` does, its ``verification.json`` left for every later check
(``inference.trust.verify_and_record``), tagged per ``tpulab.ops.tags`` with the digests, corpus,
training run, resume verdict and behaviour scores. ``promote`` trusts none of those tags: it
compares them with the files on disk, checks the record as ``serve`` and ``image build`` do and
re-verifies the artifacts against their checkpoint (``inference.trust.load_recorded``), re-runs
the behaviour suite on the candidate and on the alias's current holder, and refuses a regression
beyond ``behaviour.MARGINS``. ``rollback`` moves the alias to the version promoted before
(re-verified the same way; retired or deleted versions are skipped, and named). ``retire`` and
``delete`` refuse a version that holds an alias (MLflow would silently drop the alias on
delete). Every action is a ledger entry (``ops.ledger``) beside the store; a broken chain, or a
ledger that does not end where the store's ``LEDGER_HEAD`` tag says, refuses every command before
anything changes. An alias moved or dropped outside tpulab (the store and the ledger disagree) is
reported by every command and by ``status``' exit code, and recorded in the next entry.

Changes are committed under ``registry_ledger.lock`` (flock) beside the store, after checking
that nothing changed while the artifacts were verified unlocked (``unchanged_since``); readers
take it shared. A store sqlite cannot write within ``LOCK_WAIT_S`` is refused up front (MLflow
itself waits 20 s on a locked sqlite store, then prints a traceback: measured with mlflow-skinny
3.17.2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import re
import sqlite3
import sys
import time
import urllib.parse
from pathlib import Path

from tpulab.checkpoint.files import sha256_file
from tpulab.checkpoint.rundir import VERDICT, ResumeVerdict, RunDir, read_json
from tpulab.errors import ExitCode, TpulabError
from tpulab.ops import behaviour, ledger
from tpulab.ops import tags as T
from tpulab.tracking.store import cause

DEFAULT_ALIAS = "champion"
LOCK_WAIT_S = 5.0
LOCK_NAME = "registry_ledger.lock"
EVAL_POLICY = "fp32"  # the cache policy the suite runs on (bf16/int8 differ from it by design)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclasses.dataclass
class Registry:
    uri: str
    db: Path
    client: object  # mlflow.tracking.MlflowClient
    experiment_id: str

    @property
    def ledger_path(self) -> Path:
        return self.db.parent / ledger.LEDGER_NAME


def check_name(name: str, what: str = "model name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TpulabError(
            f"{what} {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def check_alias(alias: str) -> str:
    check_name(alias, "alias")
    if re.fullmatch(r"[vV]\d+|latest", alias):
        raise TpulabError(f"alias {alias!r} is reserved by MLflow (v<number>, latest)")
    return alias


def store_errors():
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    return (MlflowException, SQLAlchemyError, sqlite3.Error, OSError)


@contextlib.contextmanager
def store_call(reg_or_db, what: str):
    """MLflow, SQLAlchemy, sqlite and OS errors of one store call as one line naming the store."""
    db = reg_or_db.db if isinstance(reg_or_db, Registry) else reg_or_db
    try:
        yield
    except TpulabError:
        raise
    except store_errors() as e:
        raise TpulabError(f"registry store {db}: {what} failed ({cause(e)})") from None


def _probe(db: Path, wait_s: float) -> None:
    """Refuse a file that is not a sqlite database, or that another process holds a write lock on,
    before MLflow touches it."""
    url = "file:" + urllib.parse.quote(str(db.absolute())) + "?mode=rw"
    try:
        con = sqlite3.connect(url, uri=True, timeout=wait_s, isolation_level=None)
    except sqlite3.Error as e:
        raise TpulabError(f"registry store {db} cannot be opened ({cause(e)})") from None
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise TpulabError(
                f"registry store {db} is locked by another process (no write within {wait_s:g} s); "
                "nothing was changed"
            ) from None
        raise TpulabError(f"registry store {db} is unusable ({cause(e)})") from None
    except sqlite3.DatabaseError as e:
        raise TpulabError(
            f"registry store {db} is not a readable sqlite database ({cause(e)}); "
            "nothing was changed"
        ) from None
    finally:
        con.close()


def store_uri(explicit: str | None, run_dir: str | Path | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else the trainer's store: ``mlruns.db`` beside
    ``run_dir`` (register), or in the current directory (the other commands, as ``tpulab runs``)."""
    from tpulab.tracking.store import default_uri

    return default_uri(Path(run_dir) if run_dir else Path.cwd() / "x", explicit)


def open_registry(uri: str, *, create: bool = False, wait_s: float = LOCK_WAIT_S) -> Registry:
    """The registry in the sqlite store ``uri`` (created only when ``create``), probed first."""
    if not uri.startswith("sqlite:///"):
        raise TpulabError(
            f"the registry needs a sqlite MLflow store (its ledger lives beside it), not {uri}"
        )
    db = Path(uri[len("sqlite:///") :])
    if not db.exists():
        if not create:
            raise TpulabError(
                f"no registry store at {db} (pass --tracking-uri sqlite:///PATH/mlruns.db or set "
                "MLFLOW_TRACKING_URI)"
            )
        if not db.parent.is_dir():
            raise TpulabError(f"cannot create the registry store {db}: no directory {db.parent}")
    else:
        _probe(db, wait_s)
    from tpulab.tracking.store import open_store

    with store_call(db, "opening"):
        client, exp = open_store(uri)
    return Registry(uri, db, client, exp)


@contextlib.contextmanager
def locked(reg: Registry, wait_s: float = LOCK_WAIT_S, *, shared: bool = False):
    """One registry change at a time per store (flock on a file beside it); ``shared`` for readers,
    so they never see a change half made. Held only while state is read again and committed, not
    while artifacts are verified (seconds): a reader waits well under a second."""
    path = reg.db.parent / LOCK_NAME
    if shared and not path.exists():  # no change was ever made here (a writer creates it first)
        yield
        return
    try:
        f = open(path, "r" if shared else "a")
    except OSError as e:
        raise TpulabError(f"cannot open the registry lock {path} ({e.strerror})") from None
    with f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TpulabError(
                        f"registry store {reg.db} is locked by another tpulab registry command "
                        f"(waited {wait_s:g} s for {path}); nothing was changed"
                    ) from None
                time.sleep(0.05)
        yield


# ---- reading the store ------------------------------------------------------------------------
def not_found(e) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def _model(reg: Registry, name: str):
    from mlflow.exceptions import MlflowException

    with store_call(reg, f"reading model {name}"):
        try:
            return reg.client.get_registered_model(name)
        except MlflowException as e:
            if not not_found(e):
                raise
    return None


def _version(reg: Registry, name: str, version, *, required: bool = True):
    from mlflow.exceptions import MlflowException

    with store_call(reg, f"reading {name} v{version}"):
        try:
            return reg.client.get_model_version(name, str(version))
        except MlflowException as e:
            if not not_found(e):
                raise
    if required:
        raise TpulabError(f"model {name} has no version {version} in {reg.db}")
    return None


def read_version(reg: Registry, name: str, *, version=None, alias: str | None = None):
    """The model version ``version`` of ``name``, or the one ``alias`` names: the one reader of a
    single version (commands and the service). Absent: one line naming the store."""
    from mlflow.exceptions import MlflowException

    if alias is None:
        return _version(reg, name, version)
    with store_call(reg, f"reading {name}@{alias}"):
        try:
            return reg.client.get_model_version_by_alias(name, alias)
        except MlflowException as e:
            # An unknown alias is INVALID_PARAMETER_VALUE, an unknown model RESOURCE_DOES_NOT_EXIST
            # (mlflow-skinny 3.17.2); anything else is the store failing.
            if not_found(e):
                raise TpulabError(f"no model {name} in {reg.db}") from None
            if getattr(e, "error_code", None) != "INVALID_PARAMETER_VALUE":
                raise
    raise TpulabError(f"model {name} has no alias {alias} in {reg.db}")


def _aliases(model) -> dict[str, str]:
    return {a: str(v) for a, v in (model.aliases or {}).items()} if model is not None else {}


def _retired(mv) -> bool:
    return mv.tags.get(T.RETIRED) == "true"


def consistent_ledger(reg: Registry, name: str) -> tuple[list[dict], list[dict], object]:
    """(all entries, this model's entries, the registered model or None), after checking the chain
    and that the ledger ends where the store's LEDGER_HEAD tag says."""
    entries = ledger.read_ledger(reg.ledger_path)
    mine = ledger.model_entries(entries, name)
    model = _model(reg, name)
    head = model.tags.get(T.LEDGER_HEAD) if model is not None else None
    newest = mine[-1]["sha256"] if mine else None
    if model is None and mine:
        raise TpulabError(
            f"ledger {reg.ledger_path} holds {len(mine)} entries for {name} but the store has no "
            "such model (deleted outside tpulab?); use another name"
        )
    if head != newest:
        raise TpulabError(
            f"ledger {reg.ledger_path} does not end where the store says: {name}'s newest entry "
            f"should be {(head or 'none')[:12]}, the ledger's is {(newest or 'none')[:12]} "
            "(entries removed, or the ledger replaced)"
        )
    return entries, mine, model


def unchanged_since(reg: Registry, name: str, entries: list[dict], model, mv=None) -> None:
    """Under the lock, before a commit: the ledger, the model's aliases and the version's tags are
    what the command checked before its verification ran unlocked; else refuse."""
    now, _, model_now = consistent_ledger(reg, name)
    same = [e["sha256"] for e in now] == [e["sha256"] for e in entries]
    same = same and _aliases(model_now) == _aliases(model)
    if mv is not None:
        mv_now = _version(reg, name, mv.version, required=False)
        same = same and mv_now is not None and mv_now.tags == mv.tags
    if not same:
        raise TpulabError(
            f"the registry entry of {name} changed while this command verified it (another command "
            "ran meanwhile); nothing was changed: run it again"
        )


def drift(mine: list[dict], model) -> list[str]:
    """Where the store's aliases differ from the ledger's replay: moves made outside tpulab."""
    expected = {a: s[-1] for a, s in ledger.alias_stacks(mine).items() if s}
    actual = _aliases(model)
    out = []
    for alias in sorted(set(expected) | set(actual)):
        want, got = expected.get(alias), actual.get(alias)
        if want != got:
            out.append(
                f"alias {alias} is on {'v' + got if got else 'no version'} in the store, the "
                f"ledger's last move put it on {'v' + want if want else 'no version'} "
                "(moved, or its version deleted, outside tpulab)"
            )
    return out


# ---- the evidence on disk ---------------------------------------------------------------------
def corpus_identity(run_dir: Path) -> str:
    path = RunDir(run_dir).documents
    try:
        return str(read_json(path)["identity"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TpulabError(f"cannot read the corpus identity from {path}") from None


def resume_verdict(run_dir: Path, path: str | Path | None = None) -> str:
    """The RESUME_VERDICT tag: the kill/resume verdict about ``run_dir`` (given, or the capstone's
    ``<out>/proof/verdict.json`` beside it) or "absent". A given verdict about another run is
    refused."""
    run_dir = Path(run_dir).resolve()
    candidate = Path(path) if path is not None else RunDir(run_dir.parent).proof.verdict
    if path is None and not candidate.is_file():
        return "absent"
    try:
        record = read_json(candidate)
    except (OSError, ValueError):
        raise TpulabError(f"resume verdict {candidate} is not a readable {VERDICT}") from None
    verdict = ResumeVerdict.from_dict(record, f"resume verdict {candidate}")
    about = {Path(p).resolve() for p in (verdict.reference_dir, verdict.run_dir) if p}
    if run_dir not in about:
        if path is None:
            return "absent"
        raise TpulabError(f"resume verdict {candidate} is about another run, not {run_dir}")
    return json.dumps(
        {
            "identical": verdict.identical,
            "verdict_sha256": sha256_file(candidate),
            "path": str(candidate.resolve()),
        },
        sort_keys=True,
    )


def _read_manifest(root: Path) -> tuple[dict, str]:
    from tpulab.inference.artifact_format import ARTIFACT_MANIFEST

    path = root / ARTIFACT_MANIFEST
    try:
        digest = sha256_file(path)
        manifest = read_json(path)
        manifest["source"]["run_dir"], manifest["source"]["checkpoint_manifest_sha256"]
    except FileNotFoundError:
        raise TpulabError(f"artifacts {root}: missing {ARTIFACT_MANIFEST}") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise TpulabError(
            f"artifacts {root}: {ARTIFACT_MANIFEST} is not a valid manifest"
        ) from None
    return manifest, digest


def _claims_match_disk(mv) -> tuple[Path, dict, str]:
    """Compare a version's tags with the files they describe; (artifacts dir, manifest, digest)."""
    where = f"{mv.name} v{mv.version}"
    tags = mv.tags
    missing = [k for k in (T.ARTIFACTS, T.EXPORT_MANIFEST, T.CHECKPOINT, T.CORPUS) if k not in tags]
    if missing:
        raise TpulabError(
            f"{where} lacks tag {missing[0]} (not made by tpulab registry register); refused"
        )
    root = Path(mv.source)
    if tags[T.ARTIFACTS] != mv.source:
        raise TpulabError(
            f"{where}: tag {T.ARTIFACTS} {tags[T.ARTIFACTS]} is not its source {root}"
        )
    manifest, digest = _read_manifest(root)
    if digest != tags[T.EXPORT_MANIFEST]:
        raise TpulabError(
            f"{where}: tag {T.EXPORT_MANIFEST} says {tags[T.EXPORT_MANIFEST][:12]}, the manifest "
            f"on disk hashes to {digest[:12]} (forged tag or changed artifacts); refused"
        )
    src = manifest["source"]
    if src["checkpoint_manifest_sha256"] != tags[T.CHECKPOINT]:
        raise TpulabError(
            f"{where}: tag {T.CHECKPOINT} says {tags[T.CHECKPOINT][:12]}, the manifest names "
            f"checkpoint {src['checkpoint_manifest_sha256'][:12]}; refused"
        )
    corpus = corpus_identity(Path(src["run_dir"]))
    if corpus != tags[T.CORPUS]:
        raise TpulabError(
            f"{where}: tag {T.CORPUS} says {tags[T.CORPUS][:12]}, the run's corpus is "
            f"{corpus[:12]}; refused"
        )
    verdict = tags.get(T.RESUME_VERDICT, "absent")
    if verdict != "absent":
        try:
            claim = json.loads(verdict)
            path = Path(claim["path"])
            ok = path.is_file() and sha256_file(path) == claim["verdict_sha256"]
        except (ValueError, KeyError, TypeError, OSError):
            ok = False
        if not ok:
            raise TpulabError(
                f"{where}: tag {T.RESUME_VERDICT} names a verdict file that is gone or changed; "
                "refused"
            )
    return root, manifest, digest


def verify_version(mv) -> tuple[object, dict]:
    """Tags against disk, then the artifacts' verification record checked as ``serve`` checks it
    and the artifacts re-verified against their checkpoint: (ArtifactSet, the evidence a ledger
    entry records)."""
    from tpulab.inference.trust import load_recorded

    root, manifest, digest = _claims_match_disk(mv)
    art = load_recorded(root, manifest["source"]["run_dir"])
    if art.manifest_sha256 != digest:
        raise TpulabError(f"artifacts {root} changed while they were verified; refused")
    return art, {
        "artifacts": str(root),
        "export_manifest_sha256": digest,
        "checkpoint_digest": manifest["source"]["checkpoint_manifest_sha256"],
        "checkpoint_step": art.verification["checkpoint_step"],
        "corpus_identity": mv.tags[T.CORPUS],
        "resume_verdict": mv.tags.get(T.RESUME_VERDICT, "absent"),
        "verification": art.verification,
    }


def _eval_record(result: dict) -> dict:
    """What a ledger entry keeps of an evaluation: scores (a NaN as text: the ledger is strict
    JSON), the suite's sha256, the sha256 of the whole result with every item, provenance."""
    scores = {k: v if math.isfinite(v) else str(v) for k, v in result["scores"].items()}
    whole = json.dumps(result, sort_keys=True, separators=(",", ":")).encode()
    return {
        "suite_sha256": result["suite_sha256"],
        "scores": scores,
        "results_sha256": hashlib.sha256(whole).hexdigest(),
        "provenance": result["provenance"],
    }


def _baseline(reg: Registry, name: str, holder: str | None, mine: list[dict]) -> dict | None:
    """The scores to beat: the holder's artifacts (hash-checked, tags against disk) evaluated now;
    if they are unusable, the scores the ledger recorded for it, said so."""
    from tpulab.inference.artifacts import open_artifacts

    if holder is None:
        return None
    mv = _version(reg, name, holder, required=False)
    try:
        if mv is None:
            raise TpulabError(f"{name} v{holder} is not in the store")
        root, _, digest = _claims_match_disk(mv)
        art = open_artifacts(root)
        if art.manifest_sha256 != digest:
            raise TpulabError(f"artifacts {root} changed while they were opened")
        result = behaviour.evaluate(art.engine(EVAL_POLICY))
        return {"version": holder, "source": "re-evaluated now", **_eval_record(result)}
    except TpulabError as e:
        for entry in reversed(mine):
            recorded = (entry.get("evidence") or {}).get("behaviour", {})
            if entry["version"] == holder and recorded.get("scores"):
                other = recorded["suite_sha256"] != behaviour.suite_sha256()
                return {
                    "version": holder,
                    "source": f"ledger entry {entry['seq']}"
                    + (", an older suite" if other else "")
                    + f" (its artifacts are unusable now: {e})",
                    "suite_sha256": recorded["suite_sha256"],
                    "scores": {k: float(v) for k, v in recorded["scores"].items()},
                }
        raise TpulabError(
            f"the current holder v{holder} cannot be evaluated ({e}) and the ledger records no "
            "scores for it; refused"
        ) from None


def _eval_tags(scores: dict) -> dict[str, str]:
    return {T.EVAL_PREFIX + k: repr(float(v)) for k, v in scores.items()}


def _log_evaluation(reg: Registry, name: str, version: str, result: dict, why: str) -> str:
    """The evaluation as an MLflow run (scores as metrics, every item in behaviour.json) and the
    version's EVAL_PREFIX tags; returns the run id."""
    from mlflow.entities import Metric, Param, RunTag

    c = reg.client
    with store_call(reg, f"logging the evaluation of {name} v{version}"):
        run = c.create_run(
            reg.experiment_id,
            run_name=f"behaviour {name} v{version}",
            tags={"tpulab.kind": "behaviour-eval", "tpulab.model": f"{name}/{version}"},
        )
        rid = run.info.run_id
        now = int(time.time() * 1000)
        c.log_batch(
            rid,
            metrics=[Metric(k, float(v), now, 0) for k, v in result["scores"].items()],
            params=[Param("suite_sha256", result["suite_sha256"]), Param("why", why)],
            tags=[RunTag(f"tpulab.{k}", str(v)) for k, v in result["provenance"].items()],
        )
        c.log_dict(rid, result, "behaviour.json")
        c.set_terminated(rid, "FINISHED")
        for k, v in _eval_tags(result["scores"]).items():
            c.set_model_version_tag(name, version, k, v)
    return rid


def _transact(reg, name, entries, entry, apply=lambda: None, undo=lambda: None) -> None:
    """Append ``entry``, point the model's LEDGER_HEAD at it, then ``apply`` the store change; on
    any failure put the ledger and the head back and ``undo``."""
    c, had_file = reg.client, reg.ledger_path.exists()
    mine = ledger.model_entries(entries, name)
    old_head = mine[-1]["sha256"] if mine else None
    try:
        with store_call(reg, f"recording {entry['action']} of {name} v{entry['version']}"):
            ledger.write_ledger(reg.ledger_path, [*entries, entry])
            c.set_registered_model_tag(name, T.LEDGER_HEAD, entry["sha256"])
            apply()
    except BaseException:
        # Best effort: if putting things back fails too, the next command sees the mismatch
        # (LEDGER_HEAD or drift) and says so; the first error is the one reported.
        with contextlib.suppress(*store_errors()):
            if entries or had_file:
                ledger.write_ledger(reg.ledger_path, entries)
            else:
                reg.ledger_path.unlink(missing_ok=True)
            if old_head is None:
                c.delete_registered_model_tag(name, T.LEDGER_HEAD)
            else:
                c.set_registered_model_tag(name, T.LEDGER_HEAD, old_head)
            undo()
        raise


def _warn(messages: list[str]) -> list[str]:
    for m in messages:
        print(f"warning: {m}", file=sys.stderr)
    return messages


# ---- the commands -----------------------------------------------------------------------------
def register(
    uri: str,
    artifacts: str | Path,
    name: str,
    *,
    resume_verdict_path: str | Path | None = None,
    reason: str | None = None,
    out=print,
) -> dict:
    """A new version of ``name`` in the store ``uri`` from ``artifacts``, verified against their
    checkpoint (their ``verification.json`` written, or a passing one kept) and evaluated. The
    only command that may create the store, and only once the artifacts passed: bad artifacts
    leave no new file behind."""
    from tpulab.inference.trust import verify_and_record

    check_name(name)
    if Path(uri[len("sqlite:///") :]).exists() or not uri.startswith("sqlite:///"):
        consistent_ledger(open_registry(uri), name)  # a bad store or ledger refuses now
    root = Path(artifacts).resolve()
    manifest, digest = _read_manifest(root)
    run_dir = Path(manifest["source"]["run_dir"])
    corpus = corpus_identity(run_dir)
    verdict = resume_verdict(run_dir, resume_verdict_path)
    art = verify_and_record(root)
    if art.manifest_sha256 != digest:
        raise TpulabError(f"artifacts {root} changed while they were verified; refused")
    out(
        f"verified {root}: checkpoint {art.verification['checkpoint_manifest_sha256'][:12]} step "
        f"{art.verification['checkpoint_step']}, weights bitwise, "
        f"{art.verification['endpoints_passed']} endpoints"
    )
    result = behaviour.evaluate(art.engine(EVAL_POLICY))
    reg = open_registry(uri, create=True)
    run_id = training_run_id(reg, run_dir)
    tags = {
        T.ARTIFACTS: str(root),
        T.EXPORT_MANIFEST: digest,
        T.CHECKPOINT: manifest["source"]["checkpoint_manifest_sha256"],
        T.CORPUS: corpus,
        T.RUN_ID: run_id,
        T.RESUME_VERDICT: verdict,
        **_eval_tags(result["scores"]),
    }
    c = reg.client
    with locked(reg):
        entries, mine, model = consistent_ledger(reg, name)
        _warn(drift(mine, model))
        with store_call(reg, f"registering {name}"):
            if model is None:
                c.create_registered_model(name)
            try:
                mv = c.create_model_version(name, str(root), run_id=run_id or None, tags=tags)
            except BaseException:
                if model is None:
                    c.delete_registered_model(name)
                raise
        version = str(mv.version)
        evidence = {
            "artifacts": str(root),
            "export_manifest_sha256": digest,
            "checkpoint_digest": tags[T.CHECKPOINT],
            "checkpoint_step": art.verification["checkpoint_step"],
            "corpus_identity": corpus,
            "run_id": run_id,
            "resume_verdict": verdict,
            "verification": art.verification,
            "behaviour": _eval_record(result),
        }
        entry = ledger.make_entry(
            entries,
            "register",
            name,
            version,
            reason=reason or f"export {digest[:12]} of checkpoint {tags[T.CHECKPOINT][:12]}",
            evidence=evidence,
        )

        def undo():
            c.delete_model_version(name, version)
            if model is None:
                c.delete_registered_model(name)

        _transact(reg, name, entries, entry, undo=undo)
        _log_evaluation(reg, name, version, result, "register")
    return {
        "name": name,
        "version": version,
        "store": str(reg.db),
        "tags": tags,
        "evaluation": result,
        "entry": entry,
    }


def training_run_id(reg: Registry, run_dir: Path) -> str:
    """The MLflow run the training logged to, when it logged to this store; else ""."""
    from tpulab.tracking.store import read_run_link

    stored = read_run_link(run_dir)  # None: absent or unreadable
    if stored is None:
        return ""
    try:
        run_id = str(stored["run_id"])
        if Path(stored["tracking_uri"][len("sqlite:///") :]).resolve() != reg.db.resolve():
            return ""
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    from mlflow.exceptions import MlflowException

    try:
        reg.client.get_run(run_id)
    except MlflowException:
        return ""
    return run_id


def promote(
    reg: Registry,
    name: str,
    version: int | str,
    alias: str = DEFAULT_ALIAS,
    *,
    reason: str | None = None,
    out=print,
) -> dict:
    """Move ``alias`` to ``version`` after re-verifying it and passing the behaviour gate."""
    check_name(name)
    check_alias(alias)
    version = str(version)
    c = reg.client
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    mv = _version(reg, name, version)
    if _retired(mv):
        raise TpulabError(f"{name} v{version} is retired; it cannot be promoted")
    holder = _aliases(model).get(alias)
    if holder == version:
        raise TpulabError(f"{name} v{version} already holds {alias}; nothing to do")
    seen = _warn(drift(mine, model))
    art, evidence = verify_version(mv)
    out(
        f"verified {name} v{version}: manifest {evidence['export_manifest_sha256'][:12]}, "
        f"checkpoint {evidence['checkpoint_digest'][:12]} step {evidence['checkpoint_step']}, "
        f"weights bitwise, {art.verification['endpoints_passed']} endpoints"
    )
    result = behaviour.evaluate(art.engine(EVAL_POLICY))
    base = _baseline(reg, name, holder, mine)
    out(score_table(result["scores"], base))
    failures = behaviour.gate(result["scores"], base and base["scores"])
    if failures:
        against = f" against {alias} v{holder}" if holder else ""
        raise TpulabError(
            f"promotion of {name} v{version} to {alias} refused by the behaviour "
            f"gate{against}: " + "; ".join(failures),
            exit_code=ExitCode.FAILED,
        )
    evidence["behaviour"] = {
        **_eval_record(result),
        "baseline": base,
        "margins": behaviour.MARGINS,
        "loss_floor": behaviour.LOSS_FLOOR,
    }
    default = f"verified against checkpoint {evidence['checkpoint_digest'][:12]}; behaviour " + (
        f"within margins of v{holder}" if holder else "above the floor (first holder)"
    )
    with locked(reg):
        unchanged_since(reg, name, entries, model, mv)
        entry = ledger.make_entry(
            entries,
            "promote",
            name,
            version,
            alias=alias,
            from_version=holder,
            reason=reason or default,
            evidence=evidence,
            **({"drift": seen} if seen else {}),
        )
        _transact(
            reg,
            name,
            entries,
            entry,
            apply=lambda: c.set_registered_model_alias(name, alias, version),
            undo=lambda: _put_alias(c, name, alias, holder),
        )
        _log_evaluation(reg, name, version, result, f"promote to {alias}")
    return {"name": name, "version": version, "alias": alias, "from": holder, "entry": entry}


def _put_alias(client, name: str, alias: str, version: str | None) -> None:
    if version is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, version)


def rollback(
    reg: Registry,
    name: str,
    alias: str = DEFAULT_ALIAS,
    *,
    reason: str | None = None,
    out=print,
) -> dict:
    """Move ``alias`` back to the version promoted before the current one, re-verified; retired and
    deleted versions are skipped (and named)."""
    check_name(name)
    check_alias(alias)
    c = reg.client
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    current = _aliases(model).get(alias)
    seen = _warn(drift(mine, model))
    stack = ledger.alias_stacks(mine).get(alias, [])
    skipped, target = [], None
    for v in reversed(stack[:-1]):
        if v == current:
            continue
        mv = _version(reg, name, v, required=False)
        if mv is None or _retired(mv):
            skipped.append(f"v{v} ({'deleted' if mv is None else 'retired'})")
            continue
        target = v
        break
    if target is None:
        also = f"; skipped {', '.join(skipped)}" if skipped else ""
        raise TpulabError(
            f"no earlier promoted version of {name} to roll {alias} back to{also}; nothing changed"
        )
    art, evidence = verify_version(mv)
    out(
        f"verified {name} v{target}: manifest {evidence['export_manifest_sha256'][:12]}, "
        f"checkpoint {evidence['checkpoint_digest'][:12]} step {evidence['checkpoint_step']}"
    )
    with locked(reg):
        unchanged_since(reg, name, entries, model, mv)
        entry = ledger.make_entry(
            entries,
            "rollback",
            name,
            target,
            alias=alias,
            from_version=current,
            skipped=skipped,
            reason=reason or f"roll {alias} back from v{current} to v{target}",
            evidence=evidence,
            **({"drift": seen} if seen else {}),
        )
        _transact(
            reg,
            name,
            entries,
            entry,
            apply=lambda: c.set_registered_model_alias(name, alias, target),
            undo=lambda: _put_alias(c, name, alias, current),
        )
    return {"name": name, "version": target, "alias": alias, "from": current, "skipped": skipped}


def _unaliased(reg: Registry, name: str, version: str, what: str):
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    mv = _version(reg, name, version)
    held = sorted(a for a, v in _aliases(model).items() if v == version)
    if held:
        raise TpulabError(
            f"{name} v{version} holds alias {', '.join(held)}: promote another version or roll "
            f"back before you {what} it; nothing changed"
        )
    seen = _warn(drift(mine, model))
    return entries, mv, seen


def retire(reg: Registry, name: str, version: int | str, *, reason: str | None = None) -> dict:
    """Mark ``version`` unservable (RETIRED tag); refused while it holds an alias."""
    check_name(name)
    version = str(version)
    c = reg.client
    with locked(reg):
        entries, mv, seen = _unaliased(reg, name, version, "retire")
        if _retired(mv):
            raise TpulabError(f"{name} v{version} is already retired")
        entry = ledger.make_entry(
            entries,
            "retire",
            name,
            version,
            reason=reason or "retired",
            evidence={"export_manifest_sha256": mv.tags.get(T.EXPORT_MANIFEST)},
            **({"drift": seen} if seen else {}),
        )
        _transact(
            reg,
            name,
            entries,
            entry,
            apply=lambda: c.set_model_version_tag(name, version, T.RETIRED, "true"),
            undo=lambda: c.delete_model_version_tag(name, version, T.RETIRED),
        )
    return {"name": name, "version": version, "entry": entry}


def delete(reg: Registry, name: str, version: int | str, *, reason: str | None = None) -> dict:
    """Delete ``version`` from the store (its files stay); refused while it holds an alias."""
    check_name(name)
    version = str(version)
    c = reg.client
    with locked(reg):
        entries, mv, seen = _unaliased(reg, name, version, "delete")
        entry = ledger.make_entry(
            entries,
            "delete",
            name,
            version,
            reason=reason or "deleted",
            evidence={"export_manifest_sha256": mv.tags.get(T.EXPORT_MANIFEST), "tags": mv.tags},
            **({"drift": seen} if seen else {}),
        )
        _transact(reg, name, entries, entry, apply=lambda: c.delete_model_version(name, version))
    return {"name": name, "version": version, "entry": entry}


def status(reg: Registry, name: str) -> dict:
    """Aliases, versions (tags, and whether the manifest on disk still matches), the ledger's
    history of ``name`` and any drift between the store and the ledger. Changes nothing."""
    check_name(name)
    with locked(reg, shared=True):
        entries, mine, model = consistent_ledger(reg, name)
        if model is None:
            raise TpulabError(f"no model {name} in {reg.db}")
        with store_call(reg, f"listing the versions of {name}"):
            versions = reg.client.search_model_versions(f"name = '{name}'")
    rows = []
    for mv in sorted(versions, key=lambda v: int(v.version)):
        try:
            _, disk = _read_manifest(Path(mv.source))
            on_disk = "ok" if disk == mv.tags.get(T.EXPORT_MANIFEST) else "differs from tag"
        except TpulabError:
            on_disk = "missing or unreadable"
        rows.append(
            {
                "version": str(mv.version),
                "retired": _retired(mv),
                "aliases": sorted(mv.aliases or []),
                "source": mv.source,
                "manifest_on_disk": on_disk,
                "tags": dict(mv.tags),
            }
        )
    return {
        "name": name,
        "store": str(reg.db),
        "ledger": str(reg.ledger_path),
        "ledger_entries": len(entries),
        "aliases": _aliases(model),
        "versions": rows,
        "history": mine,
        "drift": drift(mine, model),
    }


def score_table(scores: dict, base: dict | None) -> str:
    """Candidate against baseline, one line per score, with the margin the gate allows."""
    head = f"baseline v{base['version']} ({base['source']})" if base else "baseline: none"
    lines = [f"behaviour ({behaviour.SUITE_NAME}); {head}"]
    for name, higher in behaviour.SCORES.items():
        theirs = f"{base['scores'][name]:.4f}" if base else "-"
        sense = "higher" if higher else "lower"
        lines.append(
            f"  {name:14s} {scores[name]:.4f}  vs {theirs:>7s}  ({sense} is better, margin "
            f"{behaviour.MARGINS[name]})"
        )
    return "\n".join(lines)
