"""Orbax checkpoints with a completion marker that Orbax lacks.

A checkpoint step holds three Orbax items: ``state`` (the TrainState pytree: parameters, both Adam
moments and count, step, dropout key), ``data`` (the Grain iterator state, one file per process)
and ``meta`` (config, corpus identity, tokenizer, format). Orbax writes each step into a temporary
dir and renames it when complete; after that, and only after that, tpulab hashes every file into
``tpulab_manifest.json``. "Latest checkpoint" means the newest step whose manifest exists and
verifies. A step without one (a save cut short by a kill) or with a mismatch (corruption) is moved
aside to ``rejected_checkpoints/`` (kept, never deleted) with a one-line warning, and the newest
earlier valid step is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp

from tpulab.checkpoint.files import MANIFEST, manifest_digest, verify_manifest, write_manifest
from tpulab.errors import CheckpointError

FORMAT = "tpulab-transformer-checkpoint-v1"
# Test fixture: never write the completion marker of this step, as if the process died while its
# async save was still in flight (see tests/test_resume_proof.py).
WITHHOLD_COMMIT_ENV = "TPULAB_WITHHOLD_COMMIT_STEP"


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def step_dirs(directory: Path) -> dict[int, Path]:
    return {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()} \
        if directory.is_dir() else {}


@dataclasses.dataclass(frozen=True)
class Rejected:
    step: int
    path: Path
    reason: str
    incomplete: bool  # no marker (a save cut short) rather than a mismatch (corruption)


def scan(directory: Path) -> tuple[int | None, list[Rejected]]:
    """(newest verified step, newer steps that failed verification). Reads only; moves nothing."""
    rejected = []
    for step, path in sorted(step_dirs(directory).items(), reverse=True):
        try:
            verify_manifest(path)
            meta_path = path / "meta" / "metadata"
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
            if not meta or meta.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
            return step, rejected
        except CheckpointError as e:
            rejected.append(Rejected(step, path, str(e), not (path / MANIFEST).exists()))
    return None, rejected


class CheckpointStore:
    """Async Orbax saves, manifests committed once each save has finished, verified restores."""

    def __init__(self, directory: str | Path, *, keep: int, async_save: bool):
        self.directory = Path(directory).absolute()
        self.reject_dir = self.directory.parent / "rejected_checkpoints"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.latest, self.rejected = scan(self.directory)
        for r in self.rejected:
            _warn(f"refusing checkpoint step {r.step}: {r.reason}")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._uncommitted: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        withheld = os.environ.get(WITHHOLD_COMMIT_ENV)
        self._withheld = int(withheld) if withheld else None
        # Commits markers soon after Orbax finishes, so a kill between saves loses as little as possible.
        self._committer = threading.Thread(target=self._commit_loop, name="tpulab-ckpt-commit", daemon=True)
        self._committer.start()

    def _commit_loop(self) -> None:
        while not self._stop.wait(0.02):
            self.commit_finished()

    def quarantine(self) -> None:
        """Move refused steps out of Orbax's way (so their step numbers can be saved again); never delete."""
        for r in self.rejected:
            self.reject_dir.mkdir(parents=True, exist_ok=True)
            dest = self.reject_dir / f"{r.step}-{time.strftime('%Y%m%dT%H%M%S')}"
            shutil.move(str(r.path), dest)
            _warn(f"moved refused checkpoint step {r.step} to {dest}")
        self.rejected = []
        self.manager.reload()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: Any, data_iter: Any, meta: dict) -> None:
        # Orbax would wait for the previous save inside save() anyway; waiting here lets its marker go first.
        self.manager.wait_until_finished()
        self.commit_finished()
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave({**meta, "format": FORMAT, "step": step})))
        with self._lock:
            self._uncommitted.append(step)

    def commit_finished(self) -> None:
        """Write manifests for saves that Orbax has finalized (non-blocking; called from both threads)."""
        with self._lock:
            if not self._uncommitted or self.manager.is_saving_in_progress():
                return
            for step in self._uncommitted:
                if step == self._withheld:
                    continue
                if self.step_dir(step).is_dir():  # may already be garbage-collected by keep-N
                    write_manifest(self.step_dir(step), {"step": step})
                    self.latest = max(self.latest or 0, step)
            self._uncommitted.clear()

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self.commit_finished()

    def read_meta(self, step: int) -> dict:
        return json.loads((self.step_dir(step) / "meta" / "metadata").read_text())

    def digest(self, step: int) -> str:
        return manifest_digest(self.step_dir(step))

    def restore(self, step: int, abstract_state: Any, data_iter: Any | None) -> Any:
        """Verify again (it may have changed since the scan), then restore into the abstract target."""
        verify_manifest(self.step_dir(step))
        args = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint step {step} does not fit this model: {str(e).splitlines()[0]}") from None
        return restored["state"]

    def close(self) -> None:
        self.wait()
        self._stop.set()
        self._committer.join()
        self.manager.close()
