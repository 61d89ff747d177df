"""A resume's checks: is this the same run (config, data, tokenizer, identities, topology)?

Before the loop restores a checkpoint it compares what the checkpoint recorded with this job:
every difference is refused unless ``--force``, so a resumed run is never silently another run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tpulab.config import identity_diff, to_dict
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import TpulabError
from tpulab.train.config import MeshConfig, ObjectiveConfig, RunConfig


@dataclasses.dataclass
class Resume:
    step: int
    digest: str


def prepare_run_dir(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TpulabError(f"run dir {run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TpulabError(f"cannot create run dir {run_dir}: {e.strerror}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise TpulabError(f"run dir {run_dir} is not writable")
    return run_dir


def check_resume_identity(
    meta: dict,
    config: RunConfig,
    corpus_identity: str,
    force: bool,
    identities: dict[str, str] | None = None,
    tokenizer: str | None = TOKENIZER,
    fixed: tuple[str, ...] = (),
) -> list[str]:
    """Differences that make a resume not the same run; raises unless ``force``.

    The config (all but resume-mutable fields, and those of them the objective fixes: ``fixed``,
    dotted keys), the data identity, the tokenizer and every identity the objective names (an init
    checkpoint's digest, a dataset's) must match the checkpoint's.
    """
    saved = meta.get("config", {})
    for section, cls in (("mesh", MeshConfig), ("objective", ObjectiveConfig)):
        if section not in saved:  # written before the section existed: it used the default
            saved = {**saved, section: to_dict(cls())}
    now = to_dict(config)
    diffs = identity_diff(RunConfig, saved, now)
    for key in fixed:
        old, new = _dotted(saved, key), _dotted(now, key)
        if old != new:
            diffs.append(f"{key}: {old!r} -> {new!r} (objective.kind={config.objective.kind})")
    if meta.get("corpus_identity") != corpus_identity:
        diffs.append(
            f"corpus identity: {str(meta.get('corpus_identity'))[:12]}… -> {corpus_identity[:12]}…"
        )
    saved_ids = meta.get("identities", {})
    for name, digest in sorted((identities or {}).items()):
        if saved_ids.get(name) != digest:
            diffs.append(f"{name}: {str(saved_ids.get(name))[:12]}… -> {digest[:12]}…")
    if meta.get("tokenizer") != tokenizer:
        diffs.append("tokenizer definition")
    if diffs and not force:
        hint = (
            "tpulab reshard to move it to another mesh, or "
            if any(d.startswith("mesh.") for d in diffs)
            else ""
        )
        raise TpulabError(
            f"refusing to resume step {meta.get('step')}: it was trained with a different "
            f"{'; '.join(diffs[:3])}{' …' if len(diffs) > 3 else ''} "
            f"(use {hint}--force to resume anyway)"
        )
    return diffs


def _dotted(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_topology(meta: dict, here: dict, force: bool) -> None:
    """A checkpoint written on another mesh, process count or device count is resumed only through
    ``tpulab reshard`` or ``--force`` (the math would differ in the last bits), never silently."""
    saved = meta.get("topology")
    if saved is not None and saved != here and not force:
        raise TpulabError(
            f"refusing to resume step {meta.get('step')}: it was written on {_topo(saved)}, this "
            f"job is {_topo(here)} (use tpulab reshard to move it, or --force)"
        )


def _topo(t: dict) -> str:
    m = t.get("mesh", {})
    return (
        f"{t.get('process_count')} process(es) x {t.get('device_count')} device(s), "
        f"mesh data={m.get('data')} fsdp={m.get('fsdp')}"
    )
