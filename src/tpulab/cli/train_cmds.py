"""Transformer capstone subcommands: train, prove-resume, check, capstone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "default.yaml"


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=_path_arg, help="YAML config (default: configs/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--steps", type=int, help="train until this step (train.steps)")
    p.add_argument("--data", help="text file or directory of *.txt to train on (data.path)")
    p.add_argument("--compile-cache", type=Path, help="JAX persistent compilation cache dir")


def _path_arg(value: str) -> Path | str:
    """argparse type: ``Path(value)``, but an empty value stays ``""`` (``Path("")`` would mean ``.``)."""
    return Path(value) if value else value


def checked_path(value: Path | str, flag: str) -> Path:
    """The path of ``flag``, or a one-line error if it is empty or too long for the OS."""
    from tpulab.config import check_path

    check_path(str(value), flag)
    return Path(value)


def load_run_config(args):
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")  # quoted: a path, never YAML (null, yes, 1e3)
    if args.config is not None:
        path = checked_path(args.config, "--config")
    else:
        path = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    return load(RunConfig, path, overrides)


def cmd_train(args) -> int:
    run_dir = checked_path(args.run_dir, "--run-dir")
    config = load_run_config(args)  # before the heavy imports: a bad config fails fast
    # Temporary wiring until train() calls it at its entry (before it creates the run dir).
    from tpulab.train.memory import check_fits_host

    check_fits_host(config)
    from tpulab.train.loop import train

    summary = train(config, run_dir, force=args.force, skip_restore=tuple(args.skip_restore),
                    progress=False if args.no_progress else None, compile_cache_dir=args.compile_cache)
    verb = "preempted at" if summary["preempted"] else "trained to"
    print(f"{verb} step {summary['final_step']}: loss {summary['final_loss']:.4f}"
          + (f", val loss {summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "")
          + f" (checkpoint step {summary['latest_checkpoint']} in {args.run_dir})")
    return 0


def child_train_argv(args, run_dir: Path, extra: list[str] = ()) -> list[str]:
    """The `tpulab train` argv a proof runs in a subprocess (same interpreter, same config)."""
    from tpulab.evidence.proof import python_module_argv

    argv = python_module_argv("tpulab.cli", "train", "--run-dir", str(run_dir), "--no-progress")
    if args.config:
        argv += ["--config", str(args.config)]
    for o in args.overrides:
        argv += ["--set", o]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.data is not None:
        argv += ["--data", args.data]
    if args.compile_cache is not None:
        argv += ["--compile-cache", str(args.compile_cache)]
    return argv + list(extra)


def cmd_prove_resume(args) -> int:
    run_dir = checked_path(args.run_dir, "--run-dir")
    from tpulab.train.proof import prove_transformer_resume

    verdict = prove_transformer_resume(args, run_dir, kill_at=args.kill_at,
                                       skip_restore=tuple(args.skip_restore))
    print(f"{'IDENTICAL' if verdict['identical'] else 'NOT IDENTICAL'}: {verdict['steps_compared']} steps compared, "
          f"max |diff| {verdict['max_abs_diff']:.3g}, killed (SIGKILL) after step {verdict['kill_step']}, "
          f"resumed from step {verdict['resumed_from_step']} -> {Path(args.run_dir) / 'proof'}")
    return 0 if verdict["identical"] else 1


def cmd_check(args) -> int:
    run_dir = None if args.run_dir is None else checked_path(args.run_dir, "--run-dir")
    config = load_run_config(args)
    from tpulab.evidence.checks import print_table, run_checks

    results = run_checks(config, run_dir=run_dir)
    print_table(results)
    return 0 if all(r["passed"] for r in results) else 1


def cmd_capstone(args) -> int:
    out = checked_path(args.out, "--out")
    from tpulab.evidence.capstone import run_capstone

    report = run_capstone(args, out)
    print(f"report: {report}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train the Transformer (resumes from the newest valid checkpoint in --run-dir)")
    p.add_argument("--run-dir", required=True, type=_path_arg)
    add_config_args(p)
    p.add_argument("--force", action="store_true", help="resume even if the config or corpus changed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--skip-restore", action="append", default=[], help=argparse.SUPPRESS)  # negative controls
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser("prove-resume", help="reference run, SIGKILL'd run, fresh-process resume, overlaid curves")
    p.add_argument("--run-dir", required=True, type=_path_arg)
    add_config_args(p)
    p.add_argument("--kill-at", type=int, help="SIGKILL the second run right after this step (default: between "
                                               "checkpoints, about 60%% of the way)")
    p.add_argument("--skip-restore", action="append", default=[], help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_prove_resume)

    p = sub.add_parser("check", help="independent checks (causality, valid-token loss, disjoint data) as a table")
    p.add_argument("--run-dir", type=_path_arg, help="check this run's trained weights and data (default: fresh init)")
    add_config_args(p)
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("capstone", help="the main job: train, prove the resume, run the checks, write report.md")
    p.add_argument("--out", required=True, type=_path_arg)
    add_config_args(p)
    p.add_argument("--skip-bridge", action="store_true", help="leave out the PyTorch bridge stage")
    p.add_argument("--skip-inference", action="store_true", help="leave out the KV-cache and export stage")
    p.set_defaults(handler=cmd_capstone)
