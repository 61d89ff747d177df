"""``train(config, run_dir)``: the Transformer training loop, resumable from its own checkpoints.

A run dir holds config.yaml, env.json, documents.json, metrics.jsonl and checkpoints/. When it
already holds a valid checkpoint the run resumes from the newest one, after checking that the
config (all but step count and logging) and the corpus identity match the checkpoint's. Metrics
are read one step late (dispatch step N, then read step N-1) so the host never waits on the
device except where a number is logged. SIGTERM (a preemption notice) finishes the current step,
saves and exits 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import yaml

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.checkpoint.store import CheckpointStore
from tpulab.config import identity_diff, to_dict
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import Splits, build_splits, eval_batches, train_dataset
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.errors import CheckpointError, TpulabError
from tpulab.evidence.metrics import MetricsLog
from tpulab.evidence.proof import hold_if_requested
from tpulab.evidence.provenance import write_environment
from tpulab.model.transformer import param_count
from tpulab.perf import compile_cache
from tpulab.train.config import RunConfig
from tpulab.train.step import Steps, make_steps

SKIPPABLE = ("rng", "data")  # negative controls: parts of the state a resume may be told to drop


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


def check_resume_identity(meta: dict, config: RunConfig, corpus_identity: str, force: bool) -> list[str]:
    """Differences that make a resume not the same run; raises unless ``force``."""
    diffs = identity_diff(RunConfig, meta.get("config", {}), to_dict(config))
    if meta.get("corpus_identity") != corpus_identity:
        diffs.append(f"corpus identity: {str(meta.get('corpus_identity'))[:12]}… -> {corpus_identity[:12]}…")
    if meta.get("tokenizer") != TOKENIZER:
        diffs.append("tokenizer definition")
    if diffs and not force:
        raise TpulabError(f"refusing to resume step {meta.get('step')}: it was trained with a different "
                          f"{'; '.join(diffs[:3])}{' …' if len(diffs) > 3 else ''} (use --force to resume anyway)")
    return diffs


class _Preemption:
    """SIGTERM sets a flag; the loop saves after the current step and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._old)


def _progress(total: int, initial: int, enabled: bool | None):
    from tqdm import tqdm

    # disable=None: shown on a terminal, silent in logs and subprocesses.
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                disable=None if enabled is None else not enabled)


def evaluate(steps: Steps, params, batches) -> float:
    sums = [steps.eval(params, steps.put_batch(b)) for b in batches]
    total = sum(float(s) for s, _ in sums)
    count = sum(float(c) for _, c in sums)
    return total / max(count, 1.0)


def write_run_files(run_dir: Path, config: RunConfig, splits: Splits, n_params: int) -> dict:
    atomic_write_bytes(run_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False).encode())
    atomic_write_json(run_dir / "documents.json", splits.describe())
    return write_environment(run_dir, extra={"param_count": n_params, "precision": to_dict(config.precision),
                                             "shapes": {"batch": config.data.batch_size, "seq_len": config.data.seq_len,
                                                        "d_model": config.model.d_model,
                                                        "n_layers": config.model.n_layers,
                                                        "n_heads": config.model.n_heads,
                                                        "vocab": config.model.vocab_size}})


def train(config: RunConfig, run_dir: str | Path, *, force: bool = False, skip_restore: tuple[str, ...] = (),
          progress: bool | None = None, compile_cache_dir: str | Path | None = None) -> dict:
    """Train to ``config.train.steps``; returns a summary (final losses, steps, resume info)."""
    bad = sorted(set(skip_restore) - set(SKIPPABLE))
    if bad:
        raise TpulabError(f"unknown part to skip on restore: {bad[0]} (known: {', '.join(SKIPPABLE)})")
    run_dir = prepare_run_dir(Path(run_dir))
    compile_cache.enable(compile_cache_dir)
    splits = build_splits(load_corpus(config.data.path), config.data)
    steps = make_steps(config)
    store = CheckpointStore(run_dir / "checkpoints", keep=config.checkpoint.keep,
                            async_save=config.checkpoint.async_save)
    data_iter = iter(train_dataset(splits.train_windows, config.data, jax.process_index(), jax.process_count()))
    meta = {"config": to_dict(config), "corpus_identity": splits.corpus.identity, "tokenizer": TOKENIZER}

    t_start = time.monotonic()
    resume = None
    if store.rejected:
        if store.latest is None and not force and not all(r.incomplete for r in store.rejected):
            raise CheckpointError(f"no checkpoint in {store.directory} passes verification; refusing to start over "
                                  "(use --force to train from scratch; refused checkpoints are kept)")
        store.quarantine()
    if store.latest is not None:
        check_resume_identity(store.read_meta(store.latest), config, splits.corpus.identity, force)
        target = steps.abstract_state()
        state = store.restore(store.latest, target, None if "data" in skip_restore else data_iter)
        if "rng" in skip_restore:
            state = state._replace(rng=steps.init().rng)
        resume = Resume(store.latest, store.digest(store.latest))
    else:
        state = steps.init()
    start = int(state.step)
    if start != (resume.step if resume else 0):
        raise CheckpointError(f"checkpoint step {resume.step} holds a state at step {start}")

    env = write_run_files(run_dir, config, splits, param_count(steps.model(state.params)))
    log = MetricsLog(run_dir, resumed_from=resume.step if resume else None,
                     checkpoint_digest=resume.digest if resume else None, skip_restore=list(skip_restore),
                     backend=env["backend"], device_kind=env["device_kind"])
    val_batches = eval_batches(splits.val_windows, config.data.batch_size, config.train.eval_batches)
    total = config.train.steps
    tokens_per_step = config.data.batch_size * config.data.seq_len
    preempt = _Preemption()
    bar = _progress(total, start, progress)
    summary = {"resumed_from": resume.step if resume else None, "start_step": start}
    last_loss, last_val = math.nan, None
    pending: tuple[int, dict] | None = None  # (step, device metrics) not yet read
    t_first_step = None

    def read(step: int, m: dict) -> float:
        nonlocal last_loss
        host = {k: float(v) for k, v in jax.device_get(m).items()}
        last_loss = host["loss"]
        if config.train.crash_on_nan and not math.isfinite(last_loss):
            raise TpulabError(f"loss is {last_loss} at step {step}; last good checkpoint: step "
                              f"{store.latest} in {store.directory}", exit_code=3)
        now = time.monotonic()
        log.log(step, loss=host["loss"], lr=host["lr"], grad_norm=host["grad_norm"], tokens=int(host["tokens"]),
                wall_s=round(now - t_start, 4))
        hold_if_requested(step)
        return now

    try:
        step = start
        while step < total:
            batch = steps.put_batch(next(data_iter))
            state, metrics = steps.train(state, batch)
            step += 1
            if pending is not None:
                read(*pending)
            pending = (step, metrics)
            if t_first_step is None:
                jax.block_until_ready(metrics)
                t_first_step = time.monotonic() - t_start
            store.commit_finished()
            done = step == total or preempt.requested
            if step % config.train.eval_every == 0 or done:
                read(*pending)
                pending = None
                last_val = evaluate(steps, state.params, val_batches)
                log.event("eval", step=step, val_loss=last_val)
            if step % config.checkpoint.save_every == 0 or done:
                store.save(step, state, data_iter, meta)
            if step % config.train.log_every == 0 or done:
                rate = bar.format_dict.get("rate") or 0.0
                bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tokens_per_step * rate:.0f}")
            bar.update(step - bar.n)
            if preempt.requested:
                log.event("preempted", step=step)
                break
        if pending is not None:
            read(*pending)
        store.wait()
    finally:
        bar.close()
        preempt.restore()
        store.close()
        log.close()
    summary.update(final_step=step, final_loss=last_loss, final_val_loss=last_val, latest_checkpoint=store.latest,
                   preempted=preempt.requested, time_to_first_step_s=t_first_step,
                   wall_s=time.monotonic() - t_start, corpus_identity=splits.corpus.identity)
    atomic_write_json(run_dir / "summary.json", summary)
    return summary
