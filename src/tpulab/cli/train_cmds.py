"""Transformer capstone subcommands: train, prove-resume, check, capstone."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "default.yaml"


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML config (default: configs/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--steps", type=int, help="train until this step (train.steps)")
    p.add_argument("--data", help="text file or directory of *.txt to train on (data.path)")
    p.add_argument("--compile-cache", type=Path, help="JAX persistent compilation cache dir")


def load_run_config(args):
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data is not None:
        overrides.append(f"data.path={args.data}")
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    return load(RunConfig, path, overrides)


def cmd_train(args) -> int:
    from tpulab.train.distributed import AgreedPreemption

    preemption = AgreedPreemption()  # first: a SIGTERM from now until exit is a preemption notice, never a kill
    config = load_run_config(args)  # before the heavy imports: a bad config fails fast
    from tpulab.train.distributed import STALL_TIMEOUT_S, StepWatchdog, initialize_from_env
    from tpulab.train.hooks import HoldAfter
    from tpulab.train.loop import train

    joined = initialize_from_env(args.init_timeout)  # a launched or TPU-slice process joins its job; otherwise a no-op
    hooks = [HoldAfter(args.hold_after_step)] if args.hold_after_step else []
    if joined["distributed"] or args.stall_timeout:
        hooks.append(StepWatchdog(args.stall_timeout or STALL_TIMEOUT_S))
    summary = train(config, args.run_dir, force=args.force, skip_restore=tuple(args.skip_restore),
                    progress=False if args.no_progress else None, compile_cache_dir=args.compile_cache,
                    hooks=hooks, preemption=preemption)
    verb = "preempted at" if summary["preempted"] else "trained to"
    print(f"{verb} step {summary['final_step']}: loss {summary['final_loss']:.4f}"
          + (f", val loss {summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "")
          + f" (checkpoint step {summary['latest_checkpoint']} in {args.run_dir})", flush=True)
    return 0


def cmd_prove_resume(args) -> int:
    config = load_run_config(args)
    if args.processes:
        from tpulab.proofs.scaleout import prove_multiprocess_resume

        v = prove_multiprocess_resume(config, Path(args.run_dir), processes=args.processes,
                                      devices=args.devices_per_process, mode="stall" if args.stall else "kill",
                                      kill_at=args.kill_at, stall_timeout_s=args.stall_timeout)
        ok = v["identical"] and v["teardown_ok"]
        print(f"{'IDENTICAL' if v['identical'] else 'NOT IDENTICAL'}: process {v['event']['victim_process']} of "
              f"{args.processes} got {v['signal']} after step {v['event']['last_logged_step']}; the job ended in "
              f"{v['event']['job_end_s']:.1f}s with exit {v['event']['launcher_exit_code']} (expected "
              f"{v['expected_exit_code']}); resumed from step {v['resumed_from_step']}; curves "
              f"{'bitwise identical' if v['curves_identical'] else 'differ'}, final state "
              f"{'bitwise identical' if v['final_state_identical'] else 'differs'} -> "
              f"{Path(args.run_dir) / ('proof-' + ('stall' if args.stall else 'kill'))}")
        return 0 if ok else 1
    from tpulab.proofs.driver import verdict_text
    from tpulab.proofs.transformer import prove_transformer_resume

    verdict = prove_transformer_resume(config, Path(args.run_dir), kill_at=args.kill_at,
                                       skip_restore=tuple(args.skip_restore), compile_cache=args.compile_cache)
    print(f"{'IDENTICAL' if verdict['identical'] else 'NOT IDENTICAL'}: {verdict_text(verdict)}; killed (SIGKILL) "
          f"after step {verdict['kill_step']}, resumed from step {verdict['resumed_from_step']} -> "
          f"{Path(args.run_dir) / 'proof'}")
    return 0 if verdict["identical"] else 1


def cmd_chaos(args) -> int:
    config = load_run_config(args)
    from tpulab.proofs.chaos import run_chaos

    verdict = run_chaos(config, Path(args.run_dir), kills=args.kills, seed=args.seed, compile_cache=args.compile_cache)
    print(f"{'IDENTICAL' if verdict['identical'] else 'NOT IDENTICAL'}: {verdict['kills']} random SIGKILLs "
          f"({verdict['kills_during_save']} while a save was in flight), {verdict['segments']} process lifetimes; "
          f"{verdict['summary']} -> {Path(args.run_dir) / 'chaos'}")
    return 0 if verdict["identical"] else 1


def cmd_check(args) -> int:
    config = load_run_config(args)
    from tpulab.proofs.checks import print_table, run_checks

    results = run_checks(config, run_dir=args.run_dir)
    print_table(results)
    return 0 if all(r["passed"] for r in results) else 1


def cmd_capstone(args) -> int:
    config = load_run_config(args)
    from tpulab.orchestrate.capstone import CapstoneOptions, run_capstone

    report = run_capstone(config, Path(args.out), CapstoneOptions(
        skip_bridge=args.skip_bridge, skip_inference=args.skip_inference, chaos_kills=args.chaos_kills,
        compile_cache=args.compile_cache, skip_scaleout=args.skip_scaleout))
    print(f"report: {report}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train the Transformer (resumes from the newest valid checkpoint in --run-dir)")
    p.add_argument("--run-dir", required=True, type=Path)
    add_config_args(p)
    p.add_argument("--force", action="store_true", help="resume even if the config or corpus changed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--skip-restore", action="append", default=[], help=argparse.SUPPRESS)  # negative controls
    p.add_argument("--hold-after-step", type=int, help=argparse.SUPPRESS)  # the proof driver's fixed kill point
    p.add_argument("--init-timeout", type=int, default=120, help="seconds every process of a multi-process job "
                                                                 "has to reach the coordinator (default 120)")
    p.add_argument("--stall-timeout", type=float, help="exit with code 75 (after dumping stacks) when no step "
                                                       "finished for this many seconds (default: 300 when several "
                                                       "processes train, else off)")
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser("prove-resume", help="reference run, SIGKILL'd run, fresh-process resume, overlaid curves")
    p.add_argument("--run-dir", required=True, type=Path)
    add_config_args(p)
    p.add_argument("--kill-at", type=int, help="SIGKILL the second run right after this step (default: between "
                                               "checkpoints, about 60%% of the way)")
    p.add_argument("--skip-restore", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, help="prove it on a launched multi-process job: SIGKILL one process")
    p.add_argument("--devices-per-process", type=int, default=2, help="with --processes: host devices each")
    p.add_argument("--stall", action="store_true", help="with --processes: SIGSTOP one process instead; the "
                                                        "others' step watchdog must end the job (exit 75)")
    p.add_argument("--stall-timeout", type=float, default=10.0, help="with --processes: watchdog timeout (s)")
    p.set_defaults(handler=cmd_prove_resume)

    p = sub.add_parser("chaos", help="SIGKILL a run at random moments, resume each time, compare the whole state")
    p.add_argument("--run-dir", required=True, type=Path)
    add_config_args(p)
    p.add_argument("--kills", type=int, default=5, help="random SIGKILLs before the run may finish (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.set_defaults(handler=cmd_chaos)

    p = sub.add_parser("check", help="independent checks (causality, valid-token loss, disjoint data) as a table")
    p.add_argument("--run-dir", type=Path, help="check this run's trained weights and data (default: fresh init)")
    add_config_args(p)
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("capstone", help="the main job: train, prove the resume, run the checks, write report.md")
    p.add_argument("--out", required=True, type=Path)
    add_config_args(p)
    p.add_argument("--skip-bridge", action="store_true", help="leave out the PyTorch bridge stage")
    p.add_argument("--skip-inference", action="store_true", help="leave out the KV-cache and export stage")
    p.add_argument("--chaos-kills", type=int, default=5, help="random kills in the chaos stage (0 leaves it out)")
    p.add_argument("--skip-scaleout", action="store_true", help="leave out the 2-process kill/resume stage")
    p.set_defaults(handler=cmd_capstone)
