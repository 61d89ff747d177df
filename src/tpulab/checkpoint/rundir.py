"""The run directory: every file and subdirectory name of it, written once, and its one JSON reader.

A run dir is the interface between the layers: the trainer writes it, the proofs, tracking, reports,
capstones and cloud runs read it. Its names live here and nowhere else (``tests/test_rundir.py``
greps ``src/`` for them), so a new objective learns them from one place::

    run/
      config.yaml  env.json  documents.json  metrics.jsonl  summary.json  goodput.json
      windows.p<process>.jsonl     the window ledger, one file per process
      mlflow_run.json              which MLflow store and run this run dir logs to
      checkpoints/<step>/tpulab_manifest.json   rejected_checkpoints/
      proof/{reference,interrupted}/  verdict.json      (a kill/resume proof: two run dirs)
      chaos/{reference,victim}/  verdict.json           (the chaos test: two run dirs)

Why layer 3 (``checkpoint``): it is the lowest layer that reads or writes a run dir (the Orbax store
owns ``checkpoints/`` and ``rejected_checkpoints/``); ``data`` and ``model`` never touch one, and a
module here is importable by every layer above. The manifest's name stays where a checkpoint is
defined (``checkpoint.files.MANIFEST``, beside the code that writes and verifies it) and is
re-exported here: ``files`` cannot import this module back without an import cycle.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import yaml

from tpulab.checkpoint.files import MANIFEST, atomic_write_bytes, atomic_write_json
from tpulab.config import to_dict
from tpulab.errors import TpulabError

CONFIG = "config.yaml"
ENV = "env.json"
DOCUMENTS = "documents.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
GOODPUT = "goodput.json"
WINDOWS_GLOB = "windows.p*.jsonl"
MLFLOW_RUN = "mlflow_run.json"
CHECKPOINTS = "checkpoints"
REJECTED = "rejected_checkpoints"
VERDICT = "verdict.json"
PROOF = "proof"
CHAOS = "chaos"
REFERENCE = "reference"
INTERRUPTED = "interrupted"
VICTIM = "victim"

__all__ = [
    "CHAOS",
    "CHECKPOINTS",
    "CONFIG",
    "DOCUMENTS",
    "ENV",
    "GOODPUT",
    "INTERRUPTED",
    "MANIFEST",
    "METRICS",
    "MLFLOW_RUN",
    "PROOF",
    "REFERENCE",
    "REJECTED",
    "SUMMARY",
    "VERDICT",
    "VICTIM",
    "WINDOWS_GLOB",
    "RunDir",
    "RunSummary",
    "read_json",
    "windows_name",
    "write_config",
    "write_json",
]

_REQUIRED = object()


def windows_name(process_index: int) -> str:
    """The window ledger file of one process (each process appends only to its own)."""
    return f"windows.p{int(process_index)}.jsonl"


def read_json(path: str | os.PathLike, missing: Any = _REQUIRED) -> Any:
    """The one JSON reader: ``path``'s parsed content; ``missing`` if given and there is no file.

    A corrupt file raises ``ValueError`` (``json.JSONDecodeError``) and a missing one, without a
    ``missing`` default, ``FileNotFoundError``: callers decide what either means in their layer.
    """
    path = Path(path)
    if missing is not _REQUIRED and not path.exists():
        return missing
    return json.loads(path.read_text())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomic (temp file, fsync, rename): a reader sees the old record or the whole new one."""
    atomic_write_json(path, obj)


def write_config(path: str | os.PathLike, config: Any) -> Path:
    """A typed config as the YAML a child process (or a later reader) loads back, atomically."""
    path = Path(path)
    atomic_write_bytes(path, yaml.safe_dump(to_dict(config), sort_keys=False).encode())
    return path


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """``summary.json``: how a training run ended. Written by the trainer's loop and the bridge's
    (process 0), passed to ``Hooks.on_end``, read by the CLI, the tracking writer (in its own
    process: the message protocol carries ``to_dict()``), reports and capstones. ``None`` where a
    loop has no such number (the bridge logs no validation loss and names no identities)."""

    final_step: int
    latest_checkpoint: int | None  # the newest committed step
    final_loss: float | None = None  # NaN: no step ran in this process lifetime
    final_val_loss: float | None = None
    preempted: bool = False
    resumed_from: int | None = None
    start_step: int = 0
    time_to_first_step_s: float | None = None
    wall_s: float | None = None
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    corpus_identity: str | None = None
    identities: dict[str, str] = dataclasses.field(default_factory=dict)
    frozen_sha256: str | None = None
    step_times_s: list[float] | None = None  # the bridge's per-step wall times

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = SUMMARY) -> RunSummary:
        """The record ``d`` (one line of refusal if it is not a run summary)."""
        if not isinstance(d, dict):
            raise TpulabError(f"{where} is not a run summary (a JSON {type(d).__name__})")
        fields = dataclasses.fields(cls)
        no_default = dataclasses.MISSING
        required = {f.name for f in fields if no_default is f.default is f.default_factory}
        missing, unknown = sorted(required - d.keys()), sorted(d.keys() - {f.name for f in fields})
        if missing or unknown:
            raise TpulabError(
                f"{where} is not a run summary (missing {missing or 'nothing'}, unknown "
                f"{unknown or 'nothing'})"
            )
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class RunDir:
    """Typed paths into one run dir. Subdirectories that are run dirs themselves (a proof's
    reference and interrupted runs, the chaos victim) are ``RunDir``s; files are ``Path``s."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    def __fspath__(self) -> str:
        return os.fspath(self.root)

    def __str__(self) -> str:
        return str(self.root)

    # --- files the trainer writes ------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def env(self) -> Path:
        return self.root / ENV

    @property
    def documents(self) -> Path:
        return self.root / DOCUMENTS

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def goodput(self) -> Path:
        return self.root / GOODPUT

    @property
    def mlflow_run(self) -> Path:
        return self.root / MLFLOW_RUN

    def windows(self, process_index: int) -> Path:
        return self.root / windows_name(process_index)

    def window_files(self) -> list[Path]:
        return sorted(self.root.glob(WINDOWS_GLOB))

    # --- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def rejected_checkpoints(self) -> Path:
        return self.root / REJECTED

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / str(int(step))

    def manifest(self, step: int) -> Path:
        return self.checkpoint(step) / MANIFEST

    # --- proofs: the subdirs and their records -----------------------------------------------
    @property
    def proof(self) -> RunDir:
        return RunDir(self.root / PROOF)

    @property
    def chaos(self) -> RunDir:
        return RunDir(self.root / CHAOS)

    @property
    def reference(self) -> RunDir:
        return RunDir(self.root / REFERENCE)

    @property
    def interrupted(self) -> RunDir:
        return RunDir(self.root / INTERRUPTED)

    @property
    def victim(self) -> RunDir:
        return RunDir(self.root / VICTIM)

    @property
    def verdict(self) -> Path:
        return self.root / VERDICT

    # --- readers and writers -----------------------------------------------------------------
    def read(self, name: str, missing: Any = _REQUIRED) -> Any:
        """A JSON record of this dir by its name here (``ENV``, ``SUMMARY``, ``VERDICT``, ...)."""
        return read_json(self.root / name, missing)

    def write(self, name: str, obj: Any) -> Path:
        path = self.root / name
        write_json(path, obj)
        return path

    def write_config(self, config: Any) -> Path:
        return write_config(self.config, config)

    def read_summary(self) -> RunSummary:
        return RunSummary.from_dict(self.read(SUMMARY), str(self.summary))
