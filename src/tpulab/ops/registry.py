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

These are the actions; what they stand on, one module each: the store and its locking
(``registry_store``), the ledger checked against the store and written with every change
(``registry_check``), the evidence on disk and the evaluations (``registry_evidence``). Changes
are committed under the lock, after checking that nothing changed while the artifacts were
verified unlocked (``unchanged_since``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from tpulab.errors import ExitCode, TpulabError
from tpulab.ops import behaviour, ledger
from tpulab.ops import tags as T
from tpulab.ops.registry_check import (
    consistent_ledger,
    drift,
    transact,
    unchanged_since,
    warn,
)
from tpulab.ops.registry_evidence import (
    EVAL_POLICY,
    baseline,
    corpus_identity,
    eval_record,
    eval_tags,
    log_evaluation,
    read_manifest,
    resume_verdict,
    score_table,
    training_run_id,
    verify_version,
)
from tpulab.ops.registry_store import (
    Registry,
    aliases_of,
    check_alias,
    check_name,
    is_retired,
    locked,
    model_version,
    open_registry,
    store_call,
)

DEFAULT_ALIAS = "champion"


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
    manifest, digest = read_manifest(root)
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
        **eval_tags(result["scores"]),
    }
    c = reg.client
    with locked(reg):
        entries, mine, model = consistent_ledger(reg, name)
        warn(drift(mine, model))
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
            "behaviour": eval_record(result),
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

        transact(reg, name, entries, entry, undo=undo)
        log_evaluation(reg, name, version, result, "register")
    return {
        "name": name,
        "version": version,
        "store": str(reg.db),
        "tags": tags,
        "evaluation": result,
        "entry": entry,
    }


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
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    mv = model_version(reg, name, version)
    if is_retired(mv):
        raise TpulabError(f"{name} v{version} is retired; it cannot be promoted")
    holder = aliases_of(model).get(alias)
    if holder == version:
        raise TpulabError(f"{name} v{version} already holds {alias}; nothing to do")
    seen = warn(drift(mine, model))
    art, evidence = verify_version(mv)
    out(
        f"verified {name} v{version}: manifest {evidence['export_manifest_sha256'][:12]}, "
        f"checkpoint {evidence['checkpoint_digest'][:12]} step {evidence['checkpoint_step']}, "
        f"weights bitwise, {art.verification['endpoints_passed']} endpoints"
    )
    result = behaviour.evaluate(art.engine(EVAL_POLICY))
    base = baseline(reg, name, holder, mine)
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
        **eval_record(result),
        "baseline": base,
        "margins": behaviour.MARGINS,
        "loss_floor": behaviour.LOSS_FLOOR,
    }
    default = f"verified against checkpoint {evidence['checkpoint_digest'][:12]}; behaviour " + (
        f"within margins of v{holder}" if holder else "above the floor (first holder)"
    )
    with locked(reg):
        unchanged_since(reg, name, entries, model, mv)
        entry = _move_alias(
            reg,
            name,
            entries,
            "promote",
            alias=alias,
            holder=holder,
            to=version,
            seen=seen,
            reason=reason or default,
            evidence=evidence,
        )
        log_evaluation(reg, name, version, result, f"promote to {alias}")
    return {"name": name, "version": version, "alias": alias, "from": holder, "entry": entry}


def _commit(
    reg: Registry,
    name: str,
    entries: list[dict],
    action: str,
    version: str,
    *,
    seen,
    apply: Callable[[], None],
    undo: Callable[[], None] = lambda: None,
    **fields,
) -> dict:
    """The ledger entry of ``action`` on ``name`` v``version`` (``entries``: the ledger read under
    the lock; ``seen``: the drift it was made over, recorded), written with the store change
    ``apply``: the store changes only with the entry written, and ``undo`` puts it back when the
    entry cannot be. Returns the entry."""
    entry = ledger.make_entry(
        entries, action, name, version, **fields, **({"drift": seen} if seen else {})
    )
    transact(reg, name, entries, entry, apply=apply, undo=undo)
    return entry


def _move_alias(
    reg: Registry,
    name: str,
    entries: list[dict],
    action: str,
    *,
    alias: str,
    holder: str | None,
    to: str,
    seen,
    **fields,
) -> dict:
    """``_commit`` of ``action`` moving ``name``'s ``alias`` from ``holder`` (None: no holder)
    to version ``to``."""
    c = reg.client
    return _commit(
        reg,
        name,
        entries,
        action,
        to,
        seen=seen,
        apply=lambda: c.set_registered_model_alias(name, alias, to),
        undo=lambda: _put_alias(c, name, alias, holder),
        alias=alias,
        from_version=holder,
        **fields,
    )


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
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    current = aliases_of(model).get(alias)
    seen = warn(drift(mine, model))
    stack = ledger.alias_stacks(mine).get(alias, [])
    skipped, target = [], None
    for v in reversed(stack[:-1]):
        if v == current:
            continue
        mv = model_version(reg, name, v, required=False)
        if mv is None or is_retired(mv):
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
        _move_alias(
            reg,
            name,
            entries,
            "rollback",
            alias=alias,
            holder=current,
            to=target,
            seen=seen,
            skipped=skipped,
            reason=reason or f"roll {alias} back from v{current} to v{target}",
            evidence=evidence,
        )
    return {"name": name, "version": target, "alias": alias, "from": current, "skipped": skipped}


@contextlib.contextmanager
def _unaliased(reg: Registry, name: str, version: str, what: str):
    """Under the store's lock, ``name`` v``version`` refused unless it holds no alias (``what``:
    the change refused): yields the ledger's entries, the model version and the drift seen."""
    check_name(name)
    with locked(reg):
        yield _read_unaliased(reg, name, version, what)


def _read_unaliased(reg: Registry, name: str, version: str, what: str):
    entries, mine, model = consistent_ledger(reg, name)
    if model is None:
        raise TpulabError(f"no model {name} in {reg.db}")
    mv = model_version(reg, name, version)
    held = sorted(a for a, v in aliases_of(model).items() if v == version)
    if held:
        raise TpulabError(
            f"{name} v{version} holds alias {', '.join(held)}: promote another version or roll "
            f"back before you {what} it; nothing changed"
        )
    seen = warn(drift(mine, model))
    return entries, mv, seen


def retire(reg: Registry, name: str, version: int | str, *, reason: str | None = None) -> dict:
    """Mark ``version`` unservable (RETIRED tag); refused while it holds an alias."""
    version = str(version)
    c = reg.client
    with _unaliased(reg, name, version, "retire") as (entries, mv, seen):
        if is_retired(mv):
            raise TpulabError(f"{name} v{version} is already retired")
        entry = _commit(
            reg,
            name,
            entries,
            "retire",
            version,
            seen=seen,
            apply=lambda: c.set_model_version_tag(name, version, T.RETIRED, "true"),
            undo=lambda: c.delete_model_version_tag(name, version, T.RETIRED),
            reason=reason or "retired",
            evidence={"export_manifest_sha256": mv.tags.get(T.EXPORT_MANIFEST)},
        )
    return {"name": name, "version": version, "entry": entry}


def delete(reg: Registry, name: str, version: int | str, *, reason: str | None = None) -> dict:
    """Delete ``version`` from the store (its files stay); refused while it holds an alias."""
    version = str(version)
    c = reg.client
    with _unaliased(reg, name, version, "delete") as (entries, mv, seen):
        entry = _commit(
            reg,
            name,
            entries,
            "delete",
            version,
            seen=seen,
            apply=lambda: c.delete_model_version(name, version),
            reason=reason or "deleted",
            evidence={"export_manifest_sha256": mv.tags.get(T.EXPORT_MANIFEST), "tags": mv.tags},
        )
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
            _, disk = read_manifest(Path(mv.source))
            on_disk = "ok" if disk == mv.tags.get(T.EXPORT_MANIFEST) else "differs from tag"
        except TpulabError:
            on_disk = "missing or unreadable"
        rows.append(
            {
                "version": str(mv.version),
                "retired": is_retired(mv),
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
        "aliases": aliases_of(model),
        "versions": rows,
        "history": mine,
        "drift": drift(mine, model),
    }
