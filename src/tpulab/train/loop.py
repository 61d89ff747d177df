"""``train(config, run_dir)``: the Transformer training loop, resumable from its own checkpoints.

A run dir holds config.yaml, env.json, documents.json, metrics.jsonl and checkpoints/. When it
already holds a valid checkpoint the run resumes from the newest one, after checking that the
config (all but step count and logging) and the corpus identity match the checkpoint's. Metrics
are read one step late (dispatch step N, then read step N-1) so the host never waits on the
device except where a number is logged, and a step's numbers and state are checked finite before it
is saved, so a non-finite state is never committed. Before a fresh run's first step the objective's
audits are written to audits.json and logged; one failed, and no step is taken. SIGTERM (a
preemption notice) finishes the current step, saves and exits 0. Proofs, tests and trackers add
behaviour through ``hooks`` (tpulab.train.hooks). With several processes
(tpulab.train.distributed) every process runs this loop on its own rows of each batch and takes
part in every save; process 0 alone writes the run's files and checkpoint manifests.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpulab import compile_cache
from tpulab.checkpoint.rundir import AUDITS, DOCUMENTS, SUMMARY, RunDir, RunEnv, RunSummary
from tpulab.checkpoint.store import CheckpointStore, read_meta, scan
from tpulab.config import to_dict
from tpulab.errors import CheckpointError, ExitCode, TpulabError
from tpulab.evidence.ledger import WindowLedger
from tpulab.evidence.metrics import MetricsLog
from tpulab.evidence.provenance import write_environment
from tpulab.train import objectives
from tpulab.train.config import RunConfig
from tpulab.train.distributed import agree_identities
from tpulab.train.hooks import HookList, Hooks
from tpulab.train.memory import check_fits_host
from tpulab.train.objective import DataSource, Objective
from tpulab.train.preemption import Preemption
from tpulab.train.restore import check_older_steps
from tpulab.train.resume_checks import (
    Resume,
    check_resume_identity,
    check_topology,
    prepare_run_dir,
)
from tpulab.train.sharding import check_batch, topology
from tpulab.train.step import Steps, make_mesh, tree_digest, words_digest
from tpulab.train.step_progress import step_bar


class _NullLog:
    """What processes other than 0 log: nothing (process 0 alone writes the run's files)."""

    def log(self, *a, **k):
        pass

    def event(self, *a, **k):
        pass

    def close(self):
        pass


def evaluate(steps: Steps, params, batches) -> dict[str, float]:
    """name -> sum / weight over the batches, for every (sum, weight) the objective's eval
    returns."""
    outs = [steps.eval(params, steps.put_global(b)) for b in batches]
    return {
        name: sum(float(o[name][0]) for o in outs) / max(sum(float(o[name][1]) for o in outs), 1.0)
        for name in outs[0]
    }


def host_metrics(metrics: dict) -> dict:
    """Device scalars -> host numbers: integer dtypes (counts) as int, the rest as float; ``loss``
    first; a ``*_sha256`` key (uint32[8] words, ``step.digest_words``) as its hex digest, a string
    (PPO's behaviour policy: which weights sampled the step's rollouts). Every key an objective
    returns is kept."""
    host = jax.device_get(metrics)
    out = {"loss": float(host["loss"])}
    for k in sorted(host):
        if k != "loss":
            v = host[k]
            if k.endswith("_sha256"):
                out[k] = words_digest(v)
            else:
                out[k] = int(v) if np.issubdtype(np.asarray(v).dtype, np.integer) else float(v)
    return out


def checked_audits(audits: dict, kind: str) -> dict[str, dict]:
    """An objective's audits as the loop writes them: every entry a dict with a bool ``passed``."""
    for name, audit in audits.items():
        if not (isinstance(audit, dict) and isinstance(audit.get("passed"), bool)):
            raise TpulabError(
                f"objective {kind}: audit {name!r} is not a dict with a bool 'passed' "
                f"({audit!r:.80})"
            )
    return {name: dict(audit) for name, audit in audits.items()}


def write_run_files(
    run_dir: Path, config: RunConfig, description: dict, facts: dict, extra: dict
) -> RunEnv:
    """config.yaml, documents.json and env.json: the objective's ``run_facts`` (parameter count,
    shapes, the unit of work per step) beside the loop's own."""
    run = RunDir(run_dir)
    run.write_config(config)
    run.write(DOCUMENTS, description)
    return write_environment(
        run_dir, extra={**extra, **facts, "precision": to_dict(config.precision)}
    )


class _NonFinite(Exception):
    def __init__(self, step: int, what: str):
        super().__init__(what)
        self.step, self.what = step, what


class PhaseClock:
    """Wall time of one process lifetime split by phase, for goodput: where did the paid-for time
    go?

    ``startup`` runs from ``train()`` entry to the first dispatched step, ``first_step`` is the
    first step (its compile included), ``data`` is waiting for batches, ``eval`` and ``checkpoint``
    the time those blocked the loop, ``step`` the rest of the loop (steady-state steps, metric
    reads).
    """

    def __init__(self):
        self.t0 = time.monotonic()
        self.seconds = {
            k: 0.0 for k in ("startup", "first_step", "step", "data", "eval", "checkpoint")
        }
        self._mark = self.t0

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def total(self) -> float:
        return time.monotonic() - self.t0


@dataclasses.dataclass
class OpenRun:
    """A run whose inputs are verified and whose resume is accepted: nothing written but the dir."""

    config: RunConfig
    run_dir: Path
    mesh: Any
    objective: Objective
    data: DataSource
    identities: dict[str, str]
    fallbacks: list[dict]
    meta: dict  # what every checkpoint of this run records beside the state
    latest: int | None  # the newest verified step to resume from


def open_run(config: RunConfig, run_dir: Path, force: bool, objective: Objective | None) -> OpenRun:
    """Bad input refused before anything is created; then the objective verifies what it reads,
    the checkpoint dir is scanned read-only and the newest step's identity is checked."""
    check_fits_host(config)
    # A mesh that does not fit the devices, or a batch it cannot split: refused before any write.
    mesh = make_mesh(config)
    check_batch(config.data.batch_size, mesh)
    # before the objective reads them: a base read at an older step is said, or refused
    fallbacks = check_older_steps(config)
    objective = objective or objectives.build(config)
    data = objective.data()
    identities = objective.identities()
    agree_identities({**identities, "corpus": data.identity})
    run_dir = prepare_run_dir(run_dir)
    meta = {
        "config": to_dict(config),
        "corpus_identity": data.identity,
        "tokenizer": objective.tokenizer,
        "identities": identities,
    }
    found = scan(RunDir(run_dir).checkpoints)
    if not found.usable and not force:
        raise CheckpointError(found.refusal())
    if found.latest is not None:
        saved = read_meta(found.directory / str(found.latest))
        if saved.get("model_only"):
            raise TpulabError(
                f"{run_dir} holds a merged model, not a training state (no optimizer state or "
                f"data position); start a new run from it with objective.init={run_dir}"
            )
        check_resume_identity(
            saved,
            config,
            data.identity,
            force,
            identities,
            objective.tokenizer,
            objective.fixed_on_resume,
        )
    return OpenRun(
        config, run_dir, mesh, objective, data, identities, fallbacks, meta, found.latest
    )


@dataclasses.dataclass
class Built:
    """The state to train from: built fresh, or restored with the data position beside it."""

    state: Any
    data_iter: Any  # None: the objective's state carries its own data
    resume: Resume | None


def build_or_restore(run: OpenRun, steps: Steps, store: CheckpointStore) -> Built:
    data = run.data
    data_iter = None if data.train is None else data.train(jax.process_index(), jax.process_count())
    run.meta["data_position"] = data_iter is not None
    resume = None
    if store.latest is not None:
        state = store.restore(store.latest, steps.abstract_state(), data_iter)
        resume = Resume(store.latest, store.digest(store.latest))
    else:
        state = steps.init()
    start = int(state.step)
    if start != (resume.step if resume else 0):
        raise CheckpointError(f"checkpoint step {resume.step} holds a state at step {start}")
    return Built(state, data_iter, resume)


def open_store(run: OpenRun, steps: Steps, hooks: HookList, force: bool) -> CheckpointStore:
    """The run's checkpoint store, once the checkpoint's layout is accepted here (creating it may
    move refused steps aside)."""
    run.meta["topology"] = topology(steps.mesh)
    if run.latest is not None:
        saved = read_meta(RunDir(run.run_dir).checkpoints / str(run.latest))
        check_topology(saved, run.meta["topology"], force)
    return CheckpointStore(
        RunDir(run.run_dir).checkpoints,
        keep=run.config.checkpoint.keep,
        async_save=run.config.checkpoint.async_save,
        allow_commit=hooks.allow_commit,
        on_commit=hooks.on_checkpoint,
        primary=jax.process_index() == 0,
    )


def train(
    config: RunConfig,
    run_dir: str | Path,
    *,
    force: bool = False,
    progress: bool | None = None,
    compile_cache_dir: str | Path | None = None,
    hooks: list[Hooks] | tuple[Hooks, ...] = (),
    preemption: Preemption | None = None,
    objective: Objective | None = None,
) -> RunSummary:
    """Train to ``config.train.steps``; returns how the run ended (``summary.json``).

    ``objective`` defaults to the one ``config.objective.kind`` names. Nothing on disk changes
    before the resume is accepted (``open_run``); then the state is built or restored
    (``build_or_restore``), ``StepLoop`` trains it and ``finish`` checks and records the end.
    Every hook's ``close()`` is called once when this returns or raises.
    """
    hooks = HookList(hooks)
    try:
        return _train(
            config, run_dir, force, progress, compile_cache_dir, hooks, preemption, objective
        )
    finally:
        hooks.close()


def _train(
    config: RunConfig,
    run_dir: str | Path,
    force: bool,
    progress: bool | None,
    compile_cache_dir: str | Path | None,
    hooks: HookList,
    preemption: Preemption | None,
    objective: Objective | None,
) -> RunSummary:
    clock = PhaseClock()
    run = open_run(config, Path(run_dir), force, objective)
    compile_cache.enable(compile_cache_dir)
    steps = run.objective.steps(run.mesh)
    frozen_digest = tree_digest(steps.frozen) if steps.frozen is not None else None
    own_preemption = preemption is None
    preempt = preemption or Preemption()
    store = loop = None
    try:
        store = open_store(run, steps, hooks, force)
        built = build_or_restore(run, steps, store)
        loop = StepLoop(run, steps, store, built, hooks, clock, preempt, progress)
        loop.before_training()
        loop.run()
        summary = finish(run, loop, frozen_digest)
    except _NonFinite as e:
        store.wait()  # in-flight saves were checked before they started: let them commit
        raise TpulabError(
            f"{e.what} at step {e.step}; last good checkpoint: step {store.latest} in "
            f"{store.directory}",
            exit_code=ExitCode.BAD_STATE,
        ) from None
    except OSError as e:  # the run's own logs (metrics, window ledger) on a full or failing disk
        last = (
            f"step {store.latest} in {store.directory}"
            if store is not None and store.latest is not None
            else "none"
        )
        raise TpulabError(
            f"writing to {run.run_dir} failed: {e.strerror or e}; last valid checkpoint: {last}",
            exit_code=ExitCode.IO_FAILED,
        ) from None
    finally:
        closers = (store,) if loop is None else (loop.bar, store, loop.log, loop.ledger)
        for closer in closers:
            if closer is not None:
                try:
                    closer.close()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    if sys.exc_info()[0] is None:
                        raise
        if own_preemption:
            preempt.restore()
    if jax.process_index() == 0:
        RunDir(run.run_dir).write(SUMMARY, summary.to_dict())
    return summary


class StepLoop:
    """The steps from the built state to ``train.steps`` (or a preemption): each batch checked and
    recorded in the ledger, metrics read one step late, evaluations and saves at their cadence."""

    def __init__(self, run, steps, store, built, hooks, clock, preempt, progress):
        self.opened, self.steps, self.store, self.hooks = run, steps, store, hooks
        self.clock, self.preempt, self.config = clock, preempt, run.config
        self.state, self.data_iter, self.resume = built.state, built.data_iter, built.resume
        self.start = self.step = int(built.state.step)
        self.primary = jax.process_index() == 0  # process 0 alone writes the run's files
        self.bar = self.log = self.ledger = None
        self.last_loss, self.last_val = math.nan, None
        self.pending: tuple[int, dict] | None = None  # (step, device metrics) not yet read
        self.t_first_step = None
        self._open_records(progress)

    def _open_records(self, progress) -> None:
        """env.json, config.yaml and documents.json (process 0), the metrics log, the ledger, the
        progress bar, and the hooks' ``on_start``."""
        run, config, state, resume = self.opened, self.config, self.state, self.resume
        data, identities = run.data, run.identities
        facts = run.objective.run_facts(self.steps, state)
        described = {
            "objective": config.objective.kind,
            "identities": {"data": data.identity, **identities},
            "trained_param_count": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "optimizer_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.opt_state))),
            **run.objective.describe(self.steps, state),
            **({"init_fallback": run.fallbacks} if run.fallbacks else {}),
        }
        env = (
            write_run_files(run.run_dir, config, data.description, facts, described)
            if self.primary
            else None
        )
        self.log = (
            _NullLog()
            if not self.primary
            else MetricsLog(
                run.run_dir,
                resumed_from=resume.step if resume else None,
                checkpoint_digest=resume.digest if resume else None,
                backend=env.backend,
                device_kind=env.device_kind,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )
        )
        self.ledger = WindowLedger(
            run.run_dir, jax.process_index(), data.row_ids, data.eval_row_ids
        )
        self.ledger.record_eval(data.eval_batches)
        self.work = facts["work"]  # the unit of work (tokens, images, env steps) and per step
        self.bar = step_bar(config.train.steps, self.start, progress if self.primary else False)
        self.hooks.on_start(
            {
                "run_dir": str(run.run_dir),
                "config": config,
                "start_step": self.start,
                "total_steps": config.train.steps,
                "process_index": jax.process_index(),  # env is process 0's alone (empty elsewhere)
                "resumed_from": resume.step if resume else None,
                "checkpoint_digest": resume.digest if resume else None,
                "env": {} if env is None else env.to_dict(),  # a dict: the tracking protocol's
                "identities": {"data": data.identity, **identities},
            }
        )

    def before_training(self) -> None:
        """A fresh run's audits (written, logged; one failed: no step is taken) and, when the
        objective asks, the evaluation of its starting parameters at step 0."""
        objective, run_dir = self.opened.objective, RunDir(self.opened.run_dir)
        if self.resume is not None and run_dir.audits.exists():
            return  # audited when the run started: the resume's identity checks held it to that
        audits = checked_audits(objective.audits(self.steps, self.state), objective.kind)
        if audits:
            if self.primary:
                run_dir.write(AUDITS, audits)
            failed = sorted(name for name, a in audits.items() if not a["passed"])
            self.log.event(
                "audits", step=self.start, passed=sorted(set(audits) - set(failed)), failed=failed
            )
            if failed:
                raise TpulabError(
                    f"audit {', '.join(failed)} failed: refusing to train a curve on it "
                    f"(see {run_dir.audits})",
                    exit_code=ExitCode.FAILED,
                )
        if objective.eval_before_training and self.resume is None:
            self.evaluate()

    def read(self, step: int, m: dict) -> None:
        record = host_metrics(m)
        self.last_loss = record["loss"]
        if self.config.train.crash_on_nan and not math.isfinite(self.last_loss):
            raise _NonFinite(step, f"loss is {self.last_loss}")
        record["wall_s"] = round(self.clock.total(), 4)
        self.log.log(step, **record)
        self.hooks.on_metrics(step, record)

    def flush(self) -> None:
        """Read the step not yet read (a step's numbers are checked before its state is saved)."""
        if self.pending is not None:
            self.read(*self.pending)
            self.pending = None

    def run(self) -> None:
        config, data, clock = self.config, self.opened.data, self.clock
        total = config.train.steps
        clock.lap("startup")
        while self.step < total:
            host_batch = {} if self.data_iter is None else next(self.data_iter)
            data.check(host_batch)
            self.ledger.record_train(self.step + 1, host_batch)
            batch = self.steps.put_batch(host_batch)
            clock.lap("data")
            self.state, metrics = self.steps.train(self.state, batch)
            self.step += 1
            self.state, metrics = self.hooks.after_step(self.step, self.state, metrics)
            if self.pending is not None:
                self.read(*self.pending)
            self.pending = (self.step, metrics)
            if self.t_first_step is None:
                jax.block_until_ready(metrics)
                self.t_first_step = clock.total()
                clock.lap("first_step")
            self.store.commit_finished()
            done = self.step == total or self.preempt.requested
            clock.lap("step")
            if self.step % config.train.eval_every == 0 or done:
                self.evaluate()
            if self.step % config.checkpoint.save_every == 0 or done:
                self.save()
            if self.step % config.train.log_every == 0 or done:
                rate = self.bar.format_dict.get("rate") or 0.0
                per_s = f"{self.work['per_step'] * rate:.0f}"
                self.bar.set_postfix(
                    {"loss": f"{self.last_loss:.4f}", f"{self.work['unit']}_s": per_s}
                )
            self.bar.update(self.step - self.bar.n)
            if self.preempt.requested:
                self.log.event("preempted", step=self.step)
                break
        self.flush()
        clock.lap("step")

    def evaluate(self) -> None:
        self.flush()
        evals = evaluate(self.steps, self.state.params, self.opened.data.eval_batches)
        self.last_val = evals.get("val_loss")
        self.log.event("eval", step=self.step, **evals)
        self.hooks.on_eval(self.step, evals)
        self.clock.lap("eval")

    def save(self) -> None:
        self.flush()
        self.clock.lap("step")
        if bool(self.steps.all_finite(self.state)):
            self.store.save(self.step, self.state, self.data_iter, self.opened.meta)
        elif self.config.train.crash_on_nan:
            raise _NonFinite(self.step, "the model state holds non-finite values")
        else:
            self.log.event("save_skipped", step=self.step, reason="non-finite state")
        self.clock.lap("checkpoint")


def finish(run: OpenRun, loop: StepLoop, frozen_digest: str | None) -> RunSummary:
    """The frozen weights checked unchanged, every save committed, the summary for ``on_end``."""
    steps, store, clock = loop.steps, loop.store, loop.clock
    if frozen_digest is not None and tree_digest(steps.frozen) != frozen_digest:
        raise TpulabError(
            f"the frozen weights changed during the run ({frozen_digest[:12]}… -> "
            f"{tree_digest(steps.frozen)[:12]}…): the run is not what it claims; the "
            f"checkpoints in {store.directory} were trained against other weights",
            exit_code=ExitCode.BAD_STATE,
        )
    store.wait()
    clock.lap("checkpoint")
    summary = RunSummary(
        resumed_from=loop.resume.step if loop.resume else None,
        start_step=loop.start,
        final_step=loop.step,
        final_loss=loop.last_loss,
        final_val_loss=loop.last_val,
        latest_checkpoint=store.latest,
        preempted=loop.preempt.requested,
        time_to_first_step_s=loop.t_first_step,
        wall_s=clock.total(),
        phases_s={k: round(v, 4) for k, v in clock.seconds.items()},
        corpus_identity=run.data.identity,
        identities=run.identities,
        frozen_sha256=frozen_digest,
    )
    loop.log.event("end", step=loop.step, wall_s=round(clock.total(), 4), phases_s=summary.phases_s)
    loop.hooks.on_end(summary)
    return summary
