"""`tpulab bridge prove-resume`: the shared kill/resume proof (tpulab.proofs.driver) on a bridge
trainer, with the whole final state compared bitwise (``checkpoint.final_state_verdict``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpulab.bridge import checkpoint as C
from tpulab.bridge.config import BridgeConfig, check_backend_method, cli_flag
from tpulab.checkpoint.rundir import RunDir
from tpulab.config import to_dict
from tpulab.errors import TpulabError
from tpulab.proofs.driver import prove_resume, tpulab_argv


def train_argv(
    cfg: BridgeConfig,
    backend: str,
    method: str,
    run_dir: Path,
    *,
    restore_rng: bool = True,
    track: bool = True,
) -> list[str]:
    """argv of a child that trains (or resumes) ``cfg`` in ``run_dir``:
    `python -m tpulab.cli bridge train ...`; ``track=False`` adds --no-track (no MLflow run)."""
    args = ["bridge", "train", "--backend", backend, "--method", method, "--run-dir", str(run_dir)]
    for f in dataclasses.fields(cfg):
        args += [cli_flag(f.name), repr(getattr(cfg, f.name))]
    if not restore_rng:
        args.append("--no-restore-rng")
    if not track:
        args.append("--no-track")
    return tpulab_argv(*args)


def default_kill_at(cfg: BridgeConfig) -> int:
    """A step past the middle that is not a checkpoint step, so the resume has steps to redo."""
    k = cfg.steps // 2 + max(1, cfg.checkpoint_every // 2)
    if k % cfg.checkpoint_every == 0:
        k += 1
    return min(k, cfg.steps - 1)


def check_reference(run_dir: Path, cfg: BridgeConfig, backend: str, method: str) -> Path:
    """``run_dir`` may stand in for a proof's reference only if it trained ``cfg`` on ``backend``
    and ``method`` in one uninterrupted segment to its last step. The generator-state switch is not
    compared: it acts only on a resume, which such a run never did."""
    from tpulab.evidence.metrics import METRICS, curve, read_records, starts

    recs = read_records(run_dir)
    lifetimes = starts(recs)
    if not lifetimes:
        raise TpulabError(f"reference {run_dir} holds no bridge run ({METRICS} has no start)")
    s = lifetimes[0]
    if (s.get("backend"), s.get("method"), s.get("config")) != (backend, method, to_dict(cfg)):
        raise TpulabError(f"reference {run_dir} was trained with another config, backend or method")
    if len(lifetimes) != 1 or s.get("resumed_from") is not None:
        raise TpulabError(f"reference {run_dir} was resumed; it must be uninterrupted")
    if set(curve(recs)) != set(range(1, cfg.steps + 1)):
        raise TpulabError(f"reference {run_dir} did not log every step 1..{cfg.steps}")
    return run_dir


def prove(
    cfg: BridgeConfig,
    backend: str,
    method: str,
    run_dir: str | Path,
    *,
    kill_at: int | None = None,
    restore_rng: bool = True,
    timeout_s: float = 600,
    env: dict | None = None,
    warm_resume_cache: bool = False,
    track: bool = True,
    reference_dir: str | Path | None = None,
) -> dict:
    """Run the proof into run_dir/proof (verdict.json, overlay.png, report.md); return the
    verdict. ``track=False``: the children log no MLflow runs (the writer costs each ~2 CPU-s).
    ``reference_dir``: an uninterrupted finished run of ``cfg`` on this backend and method to
    reuse (read only; ``check_reference``) instead of training one."""
    from tpulab.bridge.backends import torch_xla_problem
    from tpulab.bridge.report import write_proof_report

    check_backend_method(backend, method)
    if backend == "torch_xla" and (problem := torch_xla_problem()):
        raise TpulabError(problem)
    if cfg.steps < 2:
        raise TpulabError(f"--steps {cfg.steps} is too few for a kill/resume proof (need >= 2)")
    kill_at = default_kill_at(cfg) if kill_at is None else kill_at
    proof = RunDir(run_dir).proof
    proof_dir = proof.root
    if proof.verdict.exists():
        raise TpulabError(f"{proof_dir} already holds a proof; use a fresh --run-dir")
    if reference_dir is not None:
        reference_dir = check_reference(Path(reference_dir), cfg, backend, method)
    label = f"{backend}/{method}" + (
        "" if restore_rng else ", generator state left out (negative control)"
    )
    verdict = prove_resume(
        lambda d: train_argv(cfg, backend, method, d, restore_rng=restore_rng, track=track),
        proof_dir,
        steps=cfg.steps,
        kill_at=kill_at,
        reference_dir=reference_dir,
        timeout_s=timeout_s,
        env=env,
        title=f"bridge {label}",
        compare_state=C.final_state_verdict,
        extra={
            "backend": backend,
            "method": method,
            "config": to_dict(cfg),
            "restore_rng": restore_rng,
            "negative_control": not restore_rng,
        },
        warm_resume_cache=warm_resume_cache,
    )
    write_proof_report(proof_dir, proof.read_verdict())  # the report says what the file says
    return verdict
