"""The run directory: every file and subdirectory name of it, written once, and its one JSON reader.

A run dir is the interface between the layers: the trainer writes it, the proofs, tracking, reports,
capstones and cloud runs read it. Its names live here and nowhere else (``tests/test_rundir.py``
greps ``src/`` for them), so a new objective learns them from one place::

    run/
      config.yaml  env.json  documents.json  metrics.jsonl  summary.json  goodput.json
      audits.json                  the objective's audits, run before its first step
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
AUDITS = "audits.json"
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
    "AUDITS",
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
    "VERDICT_DETAILS",
    "ReshardVerdict",
    "ResumeVerdict",
    "RunDir",
    "RunEnv",
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
        return _exact(cls, d, where, "run summary")


def _exact(cls: type, d: Any, where: str, what: str) -> Any:
    """``cls(**d)`` for a record whose every field is its own: one line of refusal for a field
    missing or unknown, or (raised by the class) one of the wrong type."""
    if not isinstance(d, dict):
        raise TpulabError(f"{where} is not a {what} (a JSON {type(d).__name__})")
    fields = dataclasses.fields(cls)
    no_default = dataclasses.MISSING
    required = {f.name for f in fields if no_default is f.default is f.default_factory}
    missing, unknown = sorted(required - d.keys()), sorted(d.keys() - {f.name for f in fields})
    if missing or unknown:
        raise TpulabError(
            f"{where} is not a {what} (missing {missing or 'nothing'}, unknown "
            f"{unknown or 'nothing'})"
        )
    try:
        return cls(**d)
    except TpulabError as e:
        raise TpulabError(f"{where}: {e}") from None


class _Flat:
    """A record that is one flat JSON object on disk: its declared fields beside ``details``, the
    fields only one writer writes (and only that writer's readers read)."""

    details: dict[str, Any]

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "details"}
        return {**self.details, **d}

    @classmethod
    def _from_flat(cls, d: Any, where: str, what: str, older: str = "") -> Any:
        """The flat record ``d`` (one line of refusal if a declared field is missing, a JSON
        that is no object, or a field of the wrong type); ``older`` is said when ``kind`` is
        missing (a file written before the record existed)."""
        if not isinstance(d, dict):
            raise TpulabError(f"{where} is not a {what} (a JSON {type(d).__name__})")
        shared = {f.name for f in dataclasses.fields(cls)} - {"details"}
        missing = sorted(shared - d.keys())
        if missing:
            raise TpulabError(
                f"{where} is not a {what}: missing {missing}{older * ('kind' in missing)}"
            )
        rest = {k: v for k, v in d.items() if k not in shared}
        try:
            return cls(**{k: d[k] for k in shared}, details=rest)
        except TpulabError as e:
            raise TpulabError(f"{where}: {e}") from None


def _wrong_types(record: Any, types: dict[str, tuple]) -> list[str]:
    """``name=value`` for each field of ``record`` that is not of its declared types."""
    return [
        f"{f.name}={getattr(record, f.name)!r}"
        for f in dataclasses.fields(record)
        if not _is(getattr(record, f.name), types[f.name])
    ]


# Each writer's own fields of verdict.json, beside the shared ones: what a reader may find there.
_STATE = {  # the whole-state comparison (proofs.state / bridge.checkpoint final_state_verdict)
    "first_differing_leaf",
    "leaves_compared",
    "data_position_files",  # the transformer's Grain position (the bridge has none)
    "final_state_step",
    "final_state_compared",
}
_ONE_KILL = {  # proofs.driver.judge: one kill, one resume
    "first_differing_step_before_kill",
    "first_differing_step_after_resume",
    "steps_compared_after_resume",
    "steps_redone",
}
VERDICT_DETAILS: dict[str, frozenset[str]] = {
    # proofs.driver.prove_resume: the transformer's proof (skip_restore) and the bridge's
    "resume": frozenset(
        _STATE
        | _ONE_KILL
        | {"timings", "compile_cache", "checkpoints_at_kill", "skip_restore"}
        | {"backend", "method", "config", "restore_rng", "negative_control"}
    ),
    # proofs.chaos.run_chaos: kills at random moments, one victim
    "chaos": frozenset(
        _STATE
        | {"first_differing_lifetime", "logged_segments", "resumed_from_steps", "kills"}
        | {"kills_during_save", "kill_log", "seed", "segments", "timings", "compile_cache"}
    ),
    # proofs.scaleout.prove_scaleout: one process of a multi-process job killed or stopped
    "scaleout": frozenset(
        _STATE
        | _ONE_KILL
        | {"event", "teardown", "expected_exit_code", "processes", "devices_per_process"}
        | {"stall_timeout_s", "grace_s", "stack_dumped", "timings", "teardown_ok"}
    ),
}


@dataclasses.dataclass(frozen=True)
class ResumeVerdict(_Flat):
    """``verdict.json``: what a kill/resume proof found, in the fields every proof shares. Written
    by the transformer's and the bridge's proofs (``proofs.driver.prove_resume``), the chaos test
    and the scale-out proof; read by the CLI, the reports, the preference chain and the registry.
    On disk one flat object: these fields beside ``details``, the writer's own (``VERDICT_DETAILS``
    names them per ``kind``), so older readers of the flat file keep working."""

    kind: str  # a key of VERDICT_DETAILS
    identical: bool  # curves and, where compared, the final whole state bitwise equal
    curves_identical: bool
    final_state_identical: bool | None  # None: the final state was not compared
    signal: str  # SIGKILL, or SIGSTOP (a stalled scale-out process)
    steps: int
    steps_compared: int
    max_abs_diff: float
    first_differing_step: int | None
    missing_steps: list[int]
    kill_step: int | None  # the last step logged before the kill; None: chaos (its kill_log)
    resumed_from_step: int | None  # the checkpoint the resume started from; None: chaos
    reference_dir: str  # the uninterrupted run
    run_dir: str  # the interrupted one (chaos: the victim)
    summary: str  # one sentence: what was compared and how it came out
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # a writer that builds a malformed record fails here, before anything reaches the disk
        if self.kind not in VERDICT_DETAILS:
            raise TpulabError(
                f"a verdict of unknown kind {self.kind!r} (one of {sorted(VERDICT_DETAILS)})"
            )
        wrong = _wrong_types(self, _VERDICT_TYPES)
        if wrong:
            raise TpulabError(f"a {self.kind!r} verdict with wrong types: {', '.join(wrong)}")
        unknown = sorted(set(self.details) - VERDICT_DETAILS[self.kind])
        if unknown:
            raise TpulabError(f"a {self.kind!r} verdict with unknown fields {unknown}")

    @classmethod
    def from_dict(cls, d: dict, where: str = VERDICT) -> ResumeVerdict:
        """The flat record ``d`` (one line of refusal if it is not a resume verdict: a field
        missing, one no writer of its kind writes, or a shared one of the wrong type). Files
        written before the record existed have no ``kind`` and ``summary`` and are refused, not
        guessed at: their summary is proof-layer text this layer cannot recompute, and each
        reader reads a verdict its own run just wrote (an older one: rerun the proof, minutes)."""
        older = " (written before verdicts were typed: rerun the proof)"
        return cls._from_flat(d, where, "resume verdict", older)


def _is(value: Any, types: tuple) -> bool:
    """``value`` is one of ``types``; ``list[int]`` among them: a list of ints, each checked."""
    # bool is an int in Python: a count or a step that is True/False is a wrong type here
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, list):
        items = [t.__args__ for t in types if getattr(t, "__origin__", None) is list]
        return any(all(_is(x, item) for x in value) for item in items)
    return isinstance(value, tuple(t for t in types if isinstance(t, type)))


_VERDICT_TYPES: dict[str, tuple] = {
    "kind": (str,),
    "identical": (bool,),
    "curves_identical": (bool,),
    "final_state_identical": (bool, type(None)),
    "signal": (str,),
    "steps": (int,),
    "steps_compared": (int,),
    "max_abs_diff": (float, int),
    "first_differing_step": (int, type(None)),
    "missing_steps": (list[int],),
    "kill_step": (int, type(None)),
    "resumed_from_step": (int, type(None)),
    "reference_dir": (str,),
    "run_dir": (str,),
    "summary": (str,),
    "details": (dict,),
}


@dataclasses.dataclass(frozen=True)
class ReshardVerdict:
    """``verdict.json`` of the reshard proof (``proofs.scaleout.prove_reshard``): a checkpoint of
    a 2-process job resharded onto another layout and trained on. Not a ``ResumeVerdict``: no
    process is killed, and it passes within ``rtol``, not bitwise (another layout sums in
    another order), so a reader of resume verdicts refuses it instead of reading ``identical``
    as its outcome. Every field is its own; the CLI reads it."""

    kind: str  # "reshard": what a reader finds first
    passed: bool  # restored state bitwise equal, continued curve within rtol, no step missing
    identical: bool  # the continued curve bitwise equal to the reference (not expected)
    kill_step: int  # the checkpoint resharded (the overlay's plot marks it where a kill stands)
    resumed_from_step: int  # the same step: the continued run starts from it
    max_abs_diff: float
    steps_compared: int
    continued_vs_reference: dict[str, Any]  # proofs.scaleout.compare_layout's row
    rtol: float
    reshard: dict[str, Any]  # the reshard's own record (train.reshard: leaves, from, to, ...)

    def __post_init__(self):
        if self.kind != "reshard":
            raise TpulabError(f"a reshard verdict of kind {self.kind!r}")
        wrong = _wrong_types(self, _RESHARD_TYPES)
        if wrong:
            raise TpulabError(f"a reshard verdict with wrong types: {', '.join(wrong)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = VERDICT) -> ReshardVerdict:
        return _exact(cls, d, where, "reshard verdict")


_RESHARD_TYPES: dict[str, tuple] = {
    "kind": (str,),
    "passed": (bool,),
    "identical": (bool,),
    "kill_step": (int,),
    "resumed_from_step": (int,),
    "max_abs_diff": (float, int),
    "steps_compared": (int,),
    "continued_vs_reference": (dict,),
    "rtol": (float, int),
    "reshard": (dict,),
}


@dataclasses.dataclass(frozen=True)
class RunEnv(_Flat):
    """``env.json``: what a training run ran on, as JAX reported it (never a TPU it did not
    see), and what it trains. Written once by process 0 before step 1
    (``evidence.provenance.write_environment``, called by the loop); read by the reports, the
    capstone and the benchmarks. On disk one flat object: these fields beside ``details``, the
    objective's own facts (``Objective.describe``: ``lora``, ``dpo``, ``ppo``, ``reward_model``),
    which only that objective's readers read."""

    # evidence.provenance.environment: the host, the versions, the devices
    python: str
    platform: str
    machine: str
    packages: dict[str, str | None]  # None: not installed
    git_commit: str | None  # '-dirty' when the tree had changes; None: not a git checkout
    time_utc: str
    host_allocator: str
    tpulab_placeholders: list[str]  # libtpu_env's names set off a TPU (as the receipt lists them)
    backend: str
    device_kind: str
    device_kinds: list[str]
    device_count: int
    local_device_count: int
    process_index: int
    process_count: int
    is_tpu: bool
    # train.loop: what the run trains
    objective: str
    identities: dict[str, str]  # name -> digest of every model and dataset it depends on
    param_count: int
    trained_param_count: int  # below param_count where a base is frozen (LoRA)
    optimizer_state_bytes: int
    precision: dict[str, str]  # the config's precision policy
    shapes: dict[str, int]  # batch, seq_len, d_model, n_layers, n_heads, vocab
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # the writer builds the record first: a malformed one fails before anything is written
        wrong = _wrong_types(self, _ENV_TYPES)
        if wrong:
            raise TpulabError(f"a run environment with wrong types: {', '.join(wrong)}")

    @classmethod
    def from_dict(cls, d: dict, where: str = ENV) -> RunEnv:
        """The flat record ``d`` (one line of refusal if a field is missing or of the wrong type,
        or ``d`` is no JSON object)."""
        return cls._from_flat(d, where, "run environment")


_ENV_TYPES: dict[str, tuple] = {
    **dict.fromkeys(("python", "platform", "machine", "time_utc", "host_allocator"), (str,)),
    **dict.fromkeys(("backend", "device_kind", "objective"), (str,)),
    **dict.fromkeys(("device_count", "local_device_count", "process_index"), (int,)),
    **dict.fromkeys(("process_count", "param_count", "trained_param_count"), (int,)),
    "optimizer_state_bytes": (int,),
    "git_commit": (str, type(None)),
    **dict.fromkeys(("device_kinds", "tpulab_placeholders"), (list[str],)),
    "is_tpu": (bool,),
    **dict.fromkeys(("packages", "identities", "precision", "shapes", "details"), (dict,)),
}


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

    @property
    def audits(self) -> Path:
        return self.root / AUDITS

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

    def read_verdict(self) -> ResumeVerdict:
        """This proof dir's ``verdict.json`` (a missing one: ``FileNotFoundError``)."""
        return ResumeVerdict.from_dict(self.read(VERDICT), str(self.verdict))

    def write_verdict(self, verdict: ResumeVerdict | ReshardVerdict) -> Path:
        return self.write(VERDICT, verdict.to_dict())

    def read_env(self) -> RunEnv:
        """This run's ``env.json`` (a missing one: ``FileNotFoundError``)."""
        return RunEnv.from_dict(self.read(ENV), str(self.env))

    def write_env(self, env: RunEnv) -> Path:
        return self.write(ENV, env.to_dict())
