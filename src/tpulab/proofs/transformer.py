"""The Transformer's kill/resume proof (`tpulab prove-resume`) on top of the shared driver.

Children get the run's config as a written ``config.yaml`` (never the parent's command line), so
every process of a proof trains exactly the same run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpulab.checkpoint.rundir import RunDir, write_config
from tpulab.errors import TpulabError
from tpulab.proofs.cache import cache_env
from tpulab.proofs.driver import prove_resume, tpulab_argv
from tpulab.proofs.state import final_state_verdict
from tpulab.train.config import RunConfig


def child_config(config: RunConfig) -> RunConfig:
    """What a child trainer of a proof or an orchestrated chain trains: ``objective.init_fallback``
    unset becomes refuse, since a base read at an older step would change what is proven."""
    obj = config.objective
    if obj.init is None or obj.init_fallback is not None:
        return config
    return dataclasses.replace(config, objective=dataclasses.replace(obj, init_fallback="refuse"))


def write_child_config(config: RunConfig, path: Path) -> Path:
    """The one writer of every child trainer's config (proofs, chaos, scaleout, capstone, chain)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_config(path, child_config(config))


def train_child_argv(
    config_path: Path,
    run_dir: Path,
    *,
    compile_cache: Path | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """`tpulab train` of a written config in ``run_dir``, no progress bar (logs only)."""
    argv = tpulab_argv("train", "--config", config_path, "--run-dir", run_dir, "--no-progress")
    if compile_cache is not None:
        argv += ["--compile-cache", str(compile_cache)]
    return argv + list(extra)


def default_kill_step(steps: int, save_every: int) -> int:
    """About 60% of the way, never on a checkpoint step, always after the first checkpoint."""
    k = max(int(0.6 * steps), save_every + 1)
    if k % save_every == 0:
        k += 1
    if k >= steps:
        raise TpulabError(
            f"{steps} steps leave no room to kill between checkpoints (checkpoint.save_every="
            f"{save_every}); train longer or save more often"
        )
    return k


def check_kill_step(kill_at: int, steps: int, save_every: int) -> None:
    """Refuse up front a kill that no checkpoint precedes: the resume would have nothing to resume
    from."""
    if not 0 < kill_at < steps:
        raise TpulabError(f"--kill-at {kill_at} must be between 1 and steps-1 ({steps - 1})")
    if kill_at <= save_every:
        raise TpulabError(
            f"--kill-at {kill_at} comes before the first checkpoint (step {save_every}, "
            f"checkpoint.save_every={save_every}); kill after step {save_every} or save more often"
        )


def check_reference(reference_dir: Path, config: RunConfig) -> Path:
    """An existing run may stand in for the proof's uninterrupted reference only if it is the same
    run: the same config, finished (every step logged), and never resumed (one segment)."""
    from tpulab.config import load, to_dict
    from tpulab.evidence.metrics import curve, read_records, starts

    run = RunDir(reference_dir)
    if not run.config.is_file():
        raise TpulabError(f"--reference {reference_dir} holds no run (no {run.config.name})")
    if to_dict(child_config(load(RunConfig, run.config))) != to_dict(child_config(config)):
        raise TpulabError(f"--reference {reference_dir} was trained with another config")
    recs = read_records(run.root)
    logged = curve(recs)
    if any(s not in logged for s in range(1, config.train.steps + 1)):
        raise TpulabError(
            f"--reference {reference_dir} did not finish: {len(logged)} of "
            f"{config.train.steps} steps logged"
        )
    if len(starts(recs)) != 1:
        raise TpulabError(f"--reference {reference_dir} was resumed; it must be uninterrupted")
    return run.root


def prove_transformer_resume(
    config: RunConfig,
    out_dir: Path,
    *,
    reference_dir: Path | None = None,
    kill_at: int | None = None,
    skip_restore: tuple[str, ...] = (),
    compile_cache: Path | None = None,
    warm_resume_cache: bool = False,
    env: dict | None = None,
    track: bool = True,
) -> dict:
    """Write out_dir/proof/{verdict.json, overlay.png}: per-step losses and the final whole state
    compared. ``compile_cache`` is the reference and killed runs' cache (through the environment, so
    the driver can give the resumed process its own fresh one unless ``warm_resume_cache``);
    ``env`` is added to every child's environment (the capstone's MLflow store).
    ``reference_dir``: an uninterrupted finished run of this config to reuse (read only).
    ``track=False`` passes ``--no-track`` to every child trainer (no MLflow lineage)."""
    steps, save_every = config.train.steps, config.checkpoint.save_every
    kill_at = kill_at or default_kill_step(steps, save_every)
    check_kill_step(kill_at, steps, save_every)
    if reference_dir is not None:
        reference_dir = check_reference(Path(reference_dir), config)
    proof = RunDir(out_dir).proof
    proof_dir = proof.root
    if proof.verdict.exists():
        raise TpulabError(f"{proof_dir} already holds a proof; use a fresh --run-dir")
    config_path = write_child_config(config, proof.config)
    extra = [a for part in skip_restore for a in ("--skip-restore", part)]
    extra += [] if track else ["--no-track"]
    return prove_resume(
        lambda d: train_child_argv(config_path, d, extra=extra),
        proof_dir,
        steps=steps,
        kill_at=kill_at,
        reference_dir=reference_dir,
        env={**(env or {}), **(cache_env(compile_cache) if compile_cache is not None else {})},
        title="Transformer kill/resume",
        compare_state=final_state_verdict,
        extra={"skip_restore": list(skip_restore)},
        warm_resume_cache=warm_resume_cache,
    )
