"""The evidence a registry version carries, checked against the disk: the corpus, the resume
verdict and the training run it names, its tags against the files, the artifacts verified
(``inference.trust.load_recorded``), and the behaviour evaluations (recorded, logged, tabled).
Tags are claims: every check here reads the files they describe.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from tpulab.checkpoint.files import sha256_file
from tpulab.checkpoint.rundir import VERDICT, ResumeVerdict, RunDir, read_json
from tpulab.errors import TpulabError
from tpulab.ops import behaviour
from tpulab.ops import tags as T
from tpulab.ops.registry_store import Registry, model_version, store_call

EVAL_POLICY = "fp32"  # the cache policy the suite runs on (bf16/int8 differ from it by design)


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


def read_manifest(root: Path) -> tuple[dict, str]:
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


def claims_match_disk(mv) -> tuple[Path, dict, str]:
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
    manifest, digest = read_manifest(root)
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

    root, manifest, digest = claims_match_disk(mv)
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


def eval_record(result: dict) -> dict:
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


def baseline(reg: Registry, name: str, holder: str | None, mine: list[dict]) -> dict | None:
    """The scores to beat: the holder's artifacts (hash-checked, tags against disk) evaluated now;
    if they are unusable, the scores the ledger recorded for it, said so."""
    from tpulab.inference.artifacts import open_artifacts

    if holder is None:
        return None
    mv = model_version(reg, name, holder, required=False)
    try:
        if mv is None:
            raise TpulabError(f"{name} v{holder} is not in the store")
        root, _, digest = claims_match_disk(mv)
        art = open_artifacts(root)
        if art.manifest_sha256 != digest:
            raise TpulabError(f"artifacts {root} changed while they were opened")
        result = behaviour.evaluate(art.engine(EVAL_POLICY))
        return {"version": holder, "source": "re-evaluated now", **eval_record(result)}
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


def eval_tags(scores: dict) -> dict[str, str]:
    return {T.EVAL_PREFIX + k: repr(float(v)) for k, v in scores.items()}


def log_evaluation(reg: Registry, name: str, version: str, result: dict, why: str) -> str:
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
        for k, v in eval_tags(result["scores"]).items():
            c.set_model_version_tag(name, version, k, v)
    return rid


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
