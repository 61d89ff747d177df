"""The trust chain of an exported artifact set: the verification record, its HMAC signature, and
what ``serve`` and ``generate`` load.

``verify_export`` opens the set (``artifacts.open_artifacts``: hashes, platform, shapes, pairing),
restores the checkpoint (verified by its own manifest) and compares weights and outputs with it
(``checkpoint_match``); it writes ``verification.json`` listing the sha256 of every file it
checked and where the checkpoint came from: the run dir, and whether the user named it or it was
read from the set's own manifest. Signing (an HMAC with a key) needs a run dir the user named: the
manifest's was written by whoever wrote the artifacts, and a forged set checked against its own
forged checkpoint passes every comparison. ``load_verified`` is what ``generate`` calls: the set
re-checked against a checkpoint, or matched against a passing record.

One verification for every consumer of a set that was verified: ``load_recorded`` (the record,
always; the checkpoint too when given) is what ``serve``, ``image build`` and the registry's
``promote`` and ``rollback`` load, and ``verify_and_record`` is ``register``: it verifies exactly
as ``verify_export`` does and leaves the same record, so what one accepts the others accept.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_json
from tpulab.errors import TpulabError
from tpulab.inference.artifact_format import VERIFICATION, current_platform, jax_versions, refuse
from tpulab.inference.artifacts import ArtifactSet, open_artifacts
from tpulab.inference.checkpoint_match import check_against_checkpoint

# Where the checkpoint a record was checked against came from (``checkpoint_source.given_by``).
USER = "user"  # --run-dir: the verifier named it
MANIFEST_RUN_DIR = "artifact manifest"  # read from the set itself: not independent of it


def read_key(key_file: str | Path | None) -> bytes | None:
    """The HMAC key (the file's bytes); refuses a missing or empty file."""
    if key_file is None:
        return None
    path = Path(key_file)
    try:
        key = path.read_bytes()
    except OSError as e:
        raise TpulabError(f"key file {path}: {e.strerror or e}") from None
    if len(key.strip()) < 16:
        raise TpulabError(
            f"key file {path} holds {len(key.strip())} bytes; use at least 16 random bytes"
        )
    return key


def _canonical(record: dict) -> bytes:
    body = {k: v for k, v in record.items() if k != "hmac_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _sign(record: dict, key: bytes) -> str:
    return hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()


def verify_export(
    root: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> dict:
    """Open (hash/platform/shape/pairing checks), restore the checkpoint from ``run_dir`` (default:
    the run dir the manifest names), compare weights bitwise and every endpoint's outputs.

    Returns ``{"rows": [...], "passed": bool, ...}`` and records it in ``root/verification.json``
    with the sha256 of every file checked, the checkpoint's source (``checkpoint_source``), and an
    HMAC over the record when given ``key``, which needs ``run_dir``: refused before anything is
    read or written otherwise.
    """
    if key is not None and run_dir is None:
        refuse(
            Path(root),
            "signing needs --run-dir (the checkpoint you trust): the run dir the manifest names "
            "was chosen by whoever wrote the artifacts",
        )
    art = open_artifacts(root)
    result = _check(art, run_dir)
    if key is not None:
        result["hmac_sha256"] = _sign(result, key)
    atomic_write_json(art.root / VERIFICATION, result)
    return result


def _check(art: ArtifactSet, run_dir: str | Path | None) -> dict:
    """The record ``verify_export`` writes: ``art`` compared with its checkpoint (in ``run_dir``,
    else the run dir its manifest names)."""
    given_by = USER if run_dir is not None else MANIFEST_RUN_DIR
    source_dir = Path(run_dir if run_dir is not None else art.manifest["source"]["run_dir"])
    rows, restored = check_against_checkpoint(art, source_dir)
    return {
        "manifest_sha256": art.manifest_sha256,
        "files_sha256": art.file_sha256,
        "platform": current_platform(),
        "checkpoint_step": restored.step,
        "checkpoint_manifest_sha256": restored.checkpoint_digest,
        "checkpoint_source": {
            "run_dir": str(source_dir.resolve()),
            "given_by": given_by,
            "checkpoint_dir": str(Path(restored.checkpoint_dir).resolve()),
        },
        "weights_compared": "bitwise, every tensor",
        "passed": all(r["passed"] for r in rows),
        "rows": rows,
        **jax_versions(),
    }


def require_verified(art: ArtifactSet, key: bytes | None = None) -> dict:
    """The verification record for exactly these files on this platform, all rows passed (and signed
    with ``key`` when one is given); else raise."""
    path = art.root / VERIFICATION
    if not path.is_file():
        refuse(art.root, f"not verified (run: tpulab verify-export {art.root})")
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        refuse(art.root, f"{VERIFICATION} is not valid JSON (run: tpulab verify-export {art.root})")
    if key is not None:
        mac = record.get("hmac_sha256")
        if not isinstance(mac, str):
            refuse(
                art.root,
                f"{VERIFICATION} is not signed "
                f"(run: tpulab verify-export {art.root} --key-file KEY)",
            )
        try:
            good = hmac.compare_digest(mac, _sign(record, key))
        except ValueError:  # a NaN somewhere makes the record unserializable: not what we signed
            good = False
        if not good:
            refuse(
                art.root,
                f"{VERIFICATION} signature does not match the key "
                "(forged or signed with another key)",
            )
        source = record.get("checkpoint_source")
        if not isinstance(source, dict) or source.get("given_by") != USER:
            # Signed before signing needed --run-dir: it may vouch for a forged checkpoint.
            refuse(
                art.root,
                f"{VERIFICATION} was signed without a run dir named by the verifier (re-sign: "
                f"tpulab verify-export {art.root} --run-dir RUN --key-file KEY)",
            )
    if record.get("manifest_sha256") != art.manifest_sha256:
        refuse(
            art.root,
            f"{VERIFICATION} is for another manifest (run: tpulab verify-export {art.root})",
        )
    files = record.get("files_sha256")
    if not isinstance(files, dict) or files != art.file_sha256:
        bad = sorted(
            f
            for f in art.file_sha256
            if not isinstance(files, dict) or files.get(f) != art.file_sha256[f]
        )
        refuse(
            art.root,
            f"{VERIFICATION} does not record these files' sha256 "
            f"({', '.join(bad[:3]) or 'file list differs'}; run: tpulab verify-export {art.root})",
        )
    if record.get("platform") != current_platform():
        refuse(art.root, f"verified on {record.get('platform')}, not on {current_platform()}")
    if record.get("passed") is not True:
        refuse(art.root, "verification failed; see verification.json")
    return record


def _checkpoint_summary(art: ArtifactSet, run_dir: str | Path) -> dict:
    """``art`` re-verified against the checkpoint in ``run_dir`` (refused unless every row passed):
    what ``art.verification`` says of it."""
    rows, restored = check_against_checkpoint(art, run_dir)
    failed = [r["artifact"] for r in rows if not r["passed"]]
    if failed:
        refuse(
            art.root,
            f"outputs differ from checkpoint step {restored.step}: {', '.join(failed)}",
        )
    return {
        "mode": "checkpoint",
        "run_dir": str(Path(run_dir).resolve()),
        "checkpoint_step": restored.step,
        "checkpoint_manifest_sha256": restored.checkpoint_digest,
        "weights": "bitwise equal to the checkpoint",
        "endpoints_passed": len(rows),
    }


def _record_summary(art: ArtifactSet, record: dict, key: bytes | None) -> dict:
    return {
        "mode": "record+hmac" if key is not None else "record",
        "record": VERIFICATION,
        "files_rehashed": len(art.file_sha256),
        "signed": "hmac_sha256" in record,
        "signature_checked": key is not None,
        "checkpoint_source": record.get("checkpoint_source"),
    }


def _record_sha256(art: ArtifactSet) -> str:
    return hashlib.sha256((art.root / VERIFICATION).read_bytes()).hexdigest()


def load_verified(
    root: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> ArtifactSet:
    """What ``generate`` runs: an artifact set whose every file was rehashed just now and either
    re-verified against the checkpoint in ``run_dir`` (weights bitwise, outputs compared) or
    matched against a passing verification record (signed with ``key`` when given). Every
    artifact is deserialized and shape-checked first. ``art.verification`` says which of these
    happened."""
    art = open_artifacts(root)
    if run_dir is not None:
        art.verification = _checkpoint_summary(art, run_dir)
    else:
        art.verification = _record_summary(art, require_verified(art, key), key)
    return art


def load_recorded(
    root: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> ArtifactSet:
    """The one check of a verified set, for every consumer of one (``serve`` with ``--artifacts``
    or ``--model``, ``image build``, the registry's ``promote`` and ``rollback``): every file
    rehashed and deserialized, the verification record required (``require_verified``: present,
    valid JSON, signed with ``key`` when given, these files' sha256, this platform, passed) and,
    with ``run_dir``, the set re-verified against that checkpoint too. A record missing or
    corrupt is refused here, whatever the checkpoint says, so no consumer accepts what another
    refuses."""
    art = open_artifacts(root)
    record = require_verified(art, key)
    summary = _record_summary(art, record, key)
    if run_dir is not None:
        summary = {**_checkpoint_summary(art, run_dir), "record": summary}
    art.verification = {**summary, "record_sha256": _record_sha256(art)}
    return art


def verify_and_record(root: str | Path) -> ArtifactSet:
    """``registry register``: the set verified against its checkpoint exactly as ``verify_export``
    does (the run dir its manifest names), then its record left as every later check reads it
    (``load_recorded``): a passing record for exactly these files is kept (it may be signed),
    else the new one is written. Refused, with nothing written, unless every row passed."""
    art = open_artifacts(root)
    result = _check(art, None)
    failed = [r["artifact"] for r in result["rows"] if not r["passed"]]
    if failed:
        refuse(
            art.root,
            f"outputs differ from checkpoint step {result['checkpoint_step']}: "
            + ", ".join(failed),
        )
    try:
        record = require_verified(art)
    except TpulabError:
        atomic_write_json(art.root / VERIFICATION, result)
        record = require_verified(art)  # what serve, promote and image build will read
    src = result["checkpoint_source"]
    art.verification = {
        "mode": "checkpoint",
        "run_dir": src["run_dir"],
        "checkpoint_step": result["checkpoint_step"],
        "checkpoint_manifest_sha256": result["checkpoint_manifest_sha256"],
        "weights": "bitwise equal to the checkpoint",
        "endpoints_passed": len(result["rows"]),
        "record": _record_summary(art, record, None),
        "record_sha256": _record_sha256(art),
    }
    return art
