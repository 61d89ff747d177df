"""Orbax checkpoints with a completion marker that Orbax lacks.

A checkpoint step holds three Orbax items: ``state`` (the TrainState pytree: parameters, both Adam
moments and count, step, dropout key), ``data`` (the Grain iterator state, one file per process)
and ``meta`` (config, corpus identity, tokenizer, format). Orbax writes each step into a temporary
dir and renames it when complete; after that, and only after that, tpulab hashes every file into
``tpulab_manifest.json``. "Latest checkpoint" means the newest step whose manifest exists and
verifies. Only the newest step may lack its manifest (a save cut short by a kill); an older one
without it, or any step with a mismatch, is corruption. Refused steps are moved aside to
``rejected_checkpoints/`` (kept, never deleted) with a one-line warning once the caller accepted the
resume, and the newest earlier valid step is used. Orbax temporary dirs of killed saves are removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp

from tpulab.checkpoint.files import MANIFEST, manifest_digest, verify_manifest, write_manifest
from tpulab.checkpoint.rundir import RunDir, read_json
from tpulab.errors import CheckpointError, ExitCode

FORMAT = "tpulab-transformer-checkpoint-v1"
# Orbax writes step N into "N.orbax-checkpoint-tmp-<id>", then renames it.
TMP_MARK = ".orbax-checkpoint-tmp"


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def step_dirs(directory: Path) -> dict[int, Path]:
    return (
        {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()}
        if directory.is_dir()
        else {}
    )


def tmp_dirs(directory: Path) -> list[Path]:
    """Orbax temporary dirs: saves a kill cut short before Orbax renamed them. Never checkpoints."""
    return (
        sorted(p for p in directory.iterdir() if TMP_MARK in p.name) if directory.is_dir() else []
    )


@dataclasses.dataclass(frozen=True)
class Rejected:
    step: int
    path: Path
    reason: str
    incomplete: bool  # the newest step without a marker (a save cut short), not corruption


@dataclasses.dataclass(frozen=True)
class Scan:
    """What a checkpoint dir holds, read without changing anything."""

    directory: Path
    latest: int | None  # newest step whose manifest verifies
    rejected: list[Rejected]  # steps newer than ``latest`` that failed verification
    temporary: list[Path]  # Orbax temporary dirs left by a kill

    @property
    def usable(self) -> bool:
        """A verified step exists, or nothing was ever committed (only a save cut short, or
        nothing at all)."""
        return self.latest is not None or all(r.incomplete for r in self.rejected)

    def refusal(self) -> str:
        return (
            f"no checkpoint in {self.directory} passes verification "
            f"({self.rejected[0].reason}); refusing to "
            "start over (use --force to train from scratch; refused checkpoints are kept)"
        )


def scan(directory: str | Path) -> Scan:
    """Read-only. Only the newest step may lack its marker (an interrupted save): saves are
    committed in order, each before the next starts, so an older step without one is corruption, not
    an interruption."""
    directory = Path(directory).absolute()
    rejected = []
    steps = sorted(step_dirs(directory).items(), reverse=True)
    for i, (step, path) in enumerate(steps):
        try:
            verify_manifest(path)
            meta_path = path / "meta" / "metadata"
            meta = read_json(meta_path, None)
            if not meta or meta.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
            return Scan(directory, step, rejected, tmp_dirs(directory))
        except CheckpointError as e:
            unmarked = not (path / MANIFEST).exists()
            reason = (
                str(e)
                if not unmarked or i == 0
                else f"{path} has no {MANIFEST} but is not the newest step "
                "(corrupt, not an interrupted save)"
            )
            rejected.append(Rejected(step, path, reason, unmarked and i == 0))
    return Scan(directory, None, rejected, tmp_dirs(directory))


def read_meta(step_dir: Path) -> dict:
    return read_json(Path(step_dir) / "meta" / "metadata")


def _root_cause(e: BaseException) -> str:
    """The first OS-level reason in an exception chain (ENOSPC inside Orbax's wrappers), else the
    first line."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        text = str(seen)
        for marker in (
            "No space left on device",
            "Disk quota exceeded",
            "Read-only file system",
            "Permission denied",
        ):
            if marker in text:
                return marker
        seen = seen.__cause__ or seen.__context__
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _from_orbax(record: logging.LogRecord) -> bool:
    text = (
        record.pathname
        + str(record.msg)
        + "".join(str(a) for a in (record.args or ()) if isinstance(a, str))
    )
    exc = record.exc_info[1] if record.exc_info else None
    return f"{os.sep}orbax{os.sep}" in text or "orbax" in repr(exc) or "orbax-checkpoint" in text


def _record_cause(record: logging.LogRecord) -> str:
    """What ``_root_cause`` names for the failure a log record reports."""
    if record.exc_info and record.exc_info[1] is not None:
        return _root_cause(record.exc_info[1])
    try:
        return _root_cause(Exception(record.getMessage()))
    except Exception:  # noqa: BLE001 - a record whose arguments do not format reports nothing known
        return ""


class _OrbaxEchoes(logging.Filter):
    """Drops Orbax's own ERROR records of the save failure the store reports, and nothing else.

    Orbax logs one failed save several times with tracebacks (5 records, each dozens of lines, in
    test_hardening's disk-full run with async saves) *before* the store hears of the failure at
    its next wait, and the store reports that failure as one line. So while
    a save is in flight, Orbax's ERROR records are held: if the save fails, those with the store's
    root cause (e.g. "No space left on device") are echoes, dropped and counted (the count ends the
    store's failure line); the rest, and all held records of a save that succeeds, go to the log
    when the save ends. After a failure, later echoes (late writes, asyncio at exit) are dropped
    and counted too. Outside a save, every record passes at once.
    """

    LOGGERS = (
        "absl",
        "asyncio",
    )  # asyncio: "exception was never retrieved" of Orbax's failed writes, at exit

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._saving = False
        self._held: list[logging.LogRecord] = []
        self.cause: str | None = None  # the root cause of the failure the store reported
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno < logging.ERROR
            or getattr(record, "_tpulab_released", False)
            or not _from_orbax(record)
        ):
            return True
        with self._lock:
            if self.cause is not None:
                echo = _record_cause(record) == self.cause
                self.dropped += echo
                return not echo
            if self._saving:
                self._held.append(record)
                return False
        return True

    def saving(self) -> None:
        """A save starts: hold Orbax's error records until it ends."""
        with self._lock:
            self._saving = True

    def saved(self) -> None:
        """The save ended without a failure: what was held was no echo of one."""
        with self._lock:
            held, self._held, self._saving = self._held, [], False
        _emit(held)

    def failed(self, cause: str) -> None:
        """The store reported a failure with this root cause: drop its echoes, pass the rest."""
        with self._lock:
            self.cause, self._saving = cause, False
            held, self._held = self._held, []
            rest = [r for r in held if _record_cause(r) != cause]
            self.dropped += len(held) - len(rest)
        _emit(rest)


def _emit(records: list[logging.LogRecord]) -> None:
    """Hand held records to their loggers' handlers, past the store's filter."""
    for record in records:
        record._tpulab_released = True
        logging.getLogger(record.name).handle(record)


def _is_closed_loop_echo(u) -> bool:
    """An unraisable ``RuntimeError: Event loop is closed`` raised by ``call_soon_threadsafe``: a
    tensorstore write of a failed Orbax save finishing after Orbax closed that save's event loop."""
    if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
        return False
    frames = [f.f_code.co_name for f, _ in traceback.walk_tb(u.exc_traceback)]
    return frames[-2:] == ["call_soon_threadsafe", "_check_closed"]


def _drop_closed_loop_echoes() -> None:
    """When a save fails, Orbax closes that save's event loop while other writes are still in
    flight; as they complete on tensorstore's threads they post to the closed loop, and Python
    prints each as an unraisable traceback (dozens per run, before or after the store notices the
    failure). They are echoes of the failure the store reports as one line, so they are dropped; any
    other unraisable is printed as before."""
    previous = sys.unraisablehook
    if getattr(previous, "_tpulab_drops_closed_loop_echoes", False):
        return

    def hook(u):
        if not _is_closed_loop_echo(u):
            previous(u)

    hook._tpulab_drops_closed_loop_echoes = True
    sys.unraisablehook = hook


class _Manager(ocp.CheckpointManager):
    """Orbax's manager without its own reads of JAX's preemption sync point.

    The sync point is one counter per process: the coordination service stops the job at (the
    largest counter any process last passed) + 1, so every process must pass the same sequence of
    values. The trainer reads it once per loop check (tpulab.train.distributed.AgreedPreemption);
    Orbax would read it too, with the step number, on save and (process 0 only) when an async save
    finalizes, pulling the counters apart so that the agreed point could be one no process ever
    reads: a SIGTERM'd job would train on to its end. The trainer decides when to save; Orbax never
    needs to.
    """

    def reached_preemption(self, step: int) -> bool:
        return False


class CheckpointStore:
    """Async Orbax saves, manifests committed once each save has finished, verified restores.

    Open it only after the caller accepted ``scan(directory)`` (identity checked, refusals raised):
    opening moves refused steps aside and removes Orbax temporary dirs, so a refused resume must
    never get this far. ``allow_commit(step)`` may withhold a marker (a test's save cut short);
    ``on_commit(step)`` is told when a marker is written.

    Several processes: every process opens a store and takes part in each Orbax save (its own shards
    and its own Grain state file); only the ``primary`` process moves refused steps aside (the
    others wait for it at a barrier) and writes manifests. Orbax finalizes a step (renames its
    temporary dir) only after every process's part is written, and the manifest is written only
    after that, so a marker never covers a step some process has not finished.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        async_save: bool,
        allow_commit: Callable[[int], bool] | None = None,
        on_commit: Callable[[int], None] | None = None,
        primary: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.reject_dir = RunDir(self.directory.parent).rejected_checkpoints
        self.primary = primary
        if primary:
            self.directory.mkdir(parents=True, exist_ok=True)
        found = scan(self.directory)
        self.latest = found.latest
        if primary:
            self._quarantine(found)
        _barrier("tpulab-checkpoint-store-open")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = _Manager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self._log_filter = _OrbaxEchoes()
        _drop_closed_loop_echoes()
        for name in self._log_filter.LOGGERS:
            logging.getLogger(name).addFilter(self._log_filter)
        self._allow_commit = allow_commit or (lambda step: True)
        self._on_commit = on_commit or (lambda step: None)
        self._uncommitted: list[int] = []
        self._last_saved: int | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Commits markers soon after Orbax finishes, so a kill between saves loses as little as
        # possible.
        self._committer = threading.Thread(
            target=self._commit_loop, name="tpulab-ckpt-commit", daemon=True
        )
        self._committer.start()

    def _commit_loop(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.commit_finished()
            except CheckpointError:
                # Recorded in self._failure; the training thread raises it at its next save or wait.
                return

    def _quarantine(self, found: Scan) -> None:
        """Move refused steps out of Orbax's way (their step numbers are saved again); never delete
        them. Orbax temporary dirs are half-written saves, never checkpoints: removed, with a
        warning."""
        for r in found.rejected:
            _warn(f"refusing checkpoint step {r.step}: {r.reason}")
            self.reject_dir.mkdir(parents=True, exist_ok=True)
            dest = self.reject_dir / f"{r.step}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            shutil.move(str(r.path), dest)
            _warn(f"moved refused checkpoint step {r.step} to {dest}")
        for tmp in found.temporary:
            shutil.rmtree(tmp, ignore_errors=True)
            _warn(f"removed {tmp.name}: a save that a kill cut short before Orbax finished it")

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _record_failure(self, what: str, e: BaseException) -> CheckpointError:
        """Remember the failure (later calls raise the same line) and return the error to raise."""
        last = f"step {self.latest} in {self.directory}" if self.latest is not None else "none"
        cause = _root_cause(e)
        self._failure = (
            f"{what} in {self.directory.parent} failed: {cause}; last valid checkpoint: {last}"
        )
        self._log_filter.failed(cause)
        return self._failure_error()

    def _failure_error(self) -> CheckpointError:
        """The one line, with how many of Orbax's error records of the failure were dropped."""
        n = self._log_filter.dropped
        echoes = f"; {n} Orbax error records of this failure suppressed" if n else ""
        return CheckpointError(self._failure + echoes, exit_code=ExitCode.IO_FAILED)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure_error()

    def save(self, step: int, state: Any, data_iter: Any | None, meta: dict) -> None:
        """Save ``step`` in the background; ``data_iter`` None writes a model without a data
        position (``tpulab merge-lora``'s output: not a resumable training state)."""
        # Orbax would wait for the previous save inside save() anyway; waiting here lets its
        # marker go first.
        self.wait()
        self._log_filter.saving()
        items = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave({**meta, "format": FORMAT, "step": step}),
        }
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        try:
            self.manager.save(step, force=True, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - any failure to write is reported as one line
            raise self._record_failure(f"saving checkpoint step {step}", e) from None
        with self._lock:
            self._uncommitted.append(step)
            self._last_saved = step

    def commit_finished(self) -> None:
        """Write manifests for saves that Orbax has finalized (non-blocking; called from the
        training thread and the committer)."""
        with self._lock:
            if (
                not self._uncommitted
                or self._failure is not None
                or self.manager.is_saving_in_progress()
            ):
                return
            try:
                self.manager.check_for_errors()  # a failed async save never gets a marker
            except Exception as e:  # noqa: BLE001
                raise self._record_failure(
                    f"saving checkpoint step {self._uncommitted[-1]}", e
                ) from None
            ended = False  # a save known to have finished: its held Orbax records were no echoes
            for step in self._uncommitted:
                if not self._allow_commit(step):
                    ended = True
                    continue
                if not self.primary:  # process 0 writes the marker; the step is committed for all
                    self.latest = max(self.latest or 0, step)
                    ended = True
                    continue
                # No dir: garbage-collected by keep-N, or an async save that failed and whose error
                # Orbax raises only at the next wait (then its held records are echoes).
                if self.step_dir(step).is_dir():
                    try:
                        write_manifest(self.step_dir(step), {"step": step})
                    except OSError as e:
                        raise self._record_failure(
                            f"committing checkpoint step {step}", e
                        ) from None
                    self.latest = max(self.latest or 0, step)
                    self._on_commit(step)
                    ended = True
            self._uncommitted.clear()
            if ended:  # under the lock: the next save cannot start before this
                self._log_filter.saved()

    def wait(self) -> None:
        """Block until in-flight saves are finished and committed; raise one line if any failed."""
        self._raise_failure()
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._record_failure(f"saving checkpoint step {self._last_saved}", e) from None
        self.commit_finished()
        self._raise_failure()

    def read_meta(self, step: int) -> dict:
        return read_meta(self.step_dir(step))

    def digest(self, step: int) -> str:
        return manifest_digest(self.step_dir(step))

    def restore(self, step: int, abstract_state: Any, data_iter: Any | None) -> Any:
        """Verify again (it may have changed since the scan), then restore into the abstract
        target."""
        verify_manifest(self.step_dir(step))
        check_fits(self.step_dir(step), abstract_state)
        args = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint step {step} does not fit this model: {str(e).splitlines()[0]}"
            ) from None
        return restored["state"]

    def close(self) -> None:
        """Finish and commit in-flight saves, stop the committer, shut Orbax down. Safe on every
        error path: the manager is closed even when the wait failed, so no background thread
        outlives the error."""
        try:
            self.wait()
        finally:
            self._stop.set()
            self._committer.join()
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - a save that already failed was reported by wait()
                if self._failure is None:
                    raise
            finally:
                # After a failure the process is about to exit on our one line: the filter stays,
                # to drop the echoes still to come.
                if self._failure is None:
                    self._log_filter.saved()
                    for name in self._log_filter.LOGGERS:
                        logging.getLogger(name).removeFilter(self._log_filter)


def _barrier(name: str) -> None:
    """Wait for every process of a multi-process job (no-op in a single process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _flat_shapes(tree: Any) -> dict[tuple[str, ...], tuple]:
    """path -> (shape, dtype) with each path component as a plain string, so a restore target
    (NamedTuples, nnx.State) and Orbax's stored metadata (nested dicts) name the same leaf the same
    way."""
    import jax

    def part(k):
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return {
        tuple(part(k) for k in path): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def check_fits(step_dir: Path, abstract_state: Any) -> None:
    """Compare the stored shapes and dtypes with the restore target before restoring, so a
    checkpoint of another model is refused in one line instead of failing inside Orbax's background
    restore threads."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(
        logging.ERROR
    )  # Orbax warns that its optional _CHECKPOINT_METADATA file is absent
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(Path(step_dir).absolute() / "state")
    finally:
        absl.setLevel(level)
    stored = _flat_shapes(getattr(meta, "item_metadata", meta))
    wanted = _flat_shapes(abstract_state)
    for path in sorted(set(stored) | set(wanted)):
        if stored.get(path) != wanted.get(path):
            have = "absent" if path not in stored else f"{stored[path][0]} {stored[path][1]}"
            need = "absent" if path not in wanted else f"{wanted[path][0]} {wanted[path][1]}"
            raise CheckpointError(
                f"checkpoint {step_dir} does not fit this model: {'/'.join(path)} is {have} in the "
                f"checkpoint, {need} in the model"
            )


def read_state(step_dir: str | Path, abstract_state: Any) -> Any:
    """Restore only the ``state`` item of a verified step, read-only (no manager, nothing moved or
    written)."""
    step_dir = Path(step_dir)
    verify_manifest(step_dir)
    check_fits(step_dir, abstract_state)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(step_dir.absolute() / "state", abstract_state)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{step_dir} does not fit this model: {str(e).splitlines()[0]}"
            ) from None
