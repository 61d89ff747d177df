"""Lineage tags and params of an MLflow run: what makes two runs comparable (corpus, split,
tokenizer, backend, versions, commit), read from the run dir's own evidence files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tpulab.checkpoint.rundir import RunDir, read_json


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: ``{"model": {"d_model": 32}}`` -> ``{"model.d_model":
    "32"}``."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def lineage_tags(run_dir: Path, env: dict | None) -> dict[str, str]:
    """Corpus identity, split hashes, tokenizer, backend/device kind, versions, commit."""
    tags: dict[str, str] = {}
    docs = read_json(RunDir(run_dir).documents, None)
    if docs is not None:
        tags.update(
            {
                "tpulab.corpus.source": str(docs.get("source")),
                "tpulab.corpus.identity": str(docs.get("identity")),
                "tpulab.split.train_sha256": _sha(docs.get("train_documents")),
                "tpulab.split.validation_sha256": _sha(docs.get("validation_documents")),
                "tpulab.split.train_documents": str(len(docs.get("train_documents", []))),
                "tpulab.split.validation_documents": str(len(docs.get("validation_documents", []))),
            }
        )
    try:
        from tpulab.data.tokenizer import DEFINITION

        tags["tpulab.tokenizer"] = json.dumps(DEFINITION, sort_keys=True)
    except ImportError:  # pragma: no cover - the data package is part of tpulab
        pass
    if env:
        for k in ("backend", "device_kind", "device_count", "process_count", "python", "platform"):
            if env.get(k) is not None:
                tags[f"tpulab.{k}"] = str(env[k])
        for name, ver in (env.get("packages") or {}).items():
            if ver:
                tags[f"tpulab.version.{name}"] = str(ver)
        if env.get("objective"):
            tags["tpulab.objective"] = str(env["objective"])
        for name, digest in (env.get("identities") or {}).items():  # every model and dataset
            tags[f"tpulab.identity.{name}"] = str(digest)
        if env.get("init_fallback"):  # a base read at an older step than its newest
            tags["tpulab.init_fallback"] = " | ".join(f["warning"] for f in env["init_fallback"])
        if env.get("git_commit"):
            tags["tpulab.git_commit"] = env["git_commit"]
            tags["mlflow.source.git.commit"] = env["git_commit"].removesuffix("-dirty")
    tags["tpulab.run_dir"] = str(run_dir.absolute())
    return tags
