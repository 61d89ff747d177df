"""Transformer capstone subcommands: train, prove-resume, check, capstone."""

from __future__ import annotations

import argparse
from pathlib import Path

from tpulab.checkpoint.rundir import ResumeVerdict, RunDir
from tpulab.cli.args import (
    add_config_args,
    add_proof_children_args,
    add_run_dir,
    add_tracking_args,
    checked_path,
    from_flags,
    load_run_config,
    path_arg,
    proof_children,
    tracker_for,
    verdict_exit,
)
from tpulab.errors import ExitCode


def cmd_train(args) -> int:
    from tpulab.train.distributed import AgreedPreemption

    preemption = (
        AgreedPreemption()
    )  # first: a SIGTERM from now until exit is a preemption notice, never a kill
    config = load_run_config(args)  # before the heavy imports: a bad config fails fast
    from tpulab.train.memory import check_fits_host

    check_fits_host(config)  # train() checks again; here it fails before jax is imported
    from tpulab.train.distributed import initialize_from_env
    from tpulab.train.hooks import HoldAfter
    from tpulab.train.loop import train

    if args.cache_stats:  # a proof's child: its compilation-cache hits and misses, from now on
        from tpulab.proofs.cache import record_cache_events

        record_cache_events(args.cache_stats)

    joined = initialize_from_env(
        args.init_timeout
    )  # a launched or TPU-slice process joins its job; otherwise a no-op
    hooks = run_health_hooks(args, args.run_dir, distributed=joined["distributed"])
    if args.hold_after_step:
        hooks.append(HoldAfter(args.hold_after_step))
    tracker = tracker_for(args, args.run_dir)
    if tracker is not None:
        hooks.insert(0, tracker)
    objective = None
    if args.skip_restore:  # a proof's negative control: a wrapper, not a switch of the loop
        from tpulab.proofs.controls import SkipRestore
        from tpulab.train.objectives import build

        objective = SkipRestore(build(config), tuple(args.skip_restore))
    summary = train(  # closes every hook, whether it returns or raises
        config,
        args.run_dir,
        force=args.force,
        objective=objective,
        progress=False if args.no_progress else None,
        compile_cache_dir=args.compile_cache,
        hooks=hooks,
        preemption=preemption,
    )
    preemption.finished()
    verb = "preempted at" if summary.preempted else "trained to"
    print(
        f"{verb} step {summary.final_step}: loss {summary.final_loss:.4f}"
        + (f", val loss {summary.final_val_loss:.4f}" if summary.final_val_loss is not None else "")
        + f" (checkpoint step {summary.latest_checkpoint} in {args.run_dir})",
        flush=True,
    )
    return ExitCode.OK


def run_health_hooks(args, run_dir: Path, *, distributed: bool) -> list:
    """The stall watchdog and plain progress lines. In a multi-process job a stall always ends the
    process (``ExitCode.STALLED``), with a 300 s default: a peer stuck inside a collective never
    errors by itself."""
    import jax

    from tpulab.train.step_progress import LogLines
    from tpulab.train.watchdog import MULTIPROCESS_STALL_S, StallWatchdog

    timeout = args.stall_timeout
    if timeout is None and distributed:
        timeout = MULTIPROCESS_STALL_S
    return [
        StallWatchdog(
            run_dir,
            exit_code=ExitCode.STALLED if (args.stall_exit or distributed) else None,
            timeout_s=timeout,
            startup_s=args.stall_startup_timeout,
            records=jax.process_index() == 0,
        ),
        LogLines(),
    ]


def cmd_prove_resume(args) -> int:
    config = load_run_config(args)
    if args.processes and (args.reference is not None or args.no_track):
        from tpulab.errors import TpulabError

        flag = "--reference" if args.reference is not None else "--no-track"
        raise TpulabError(f"{flag} is for a one-process proof; drop it or --processes")
    if args.processes:
        from tpulab.proofs.scaleout import prove_multiprocess_resume

        v = ResumeVerdict.from_dict(
            prove_multiprocess_resume(
                config,
                Path(args.run_dir),
                processes=args.processes,
                devices=args.devices_per_process,
                mode="stall" if args.stall else "kill",
                kill_at=args.kill_at,
                stall_timeout_s=args.stall_timeout,
            )
        )
        event = v.details["event"]
        return verdict_exit(
            v,
            f"process {event['victim_process']} of {args.processes} got {v.signal} after step "
            f"{event['last_logged_step']}; the job ended in {event['job_end_s']:.1f}s "
            f"with exit {event['launcher_exit_code']} (expected "
            f"{v.details['expected_exit_code']}); resumed from step {v.resumed_from_step}; curves "
            f"{'bitwise identical' if v.curves_identical else 'differ'}, final state "
            f"{'bitwise identical' if v.final_state_identical else 'differs'} -> "
            f"{Path(args.run_dir) / ('proof-' + ('stall' if args.stall else 'kill'))}",
            ok=v.identical and v.details["teardown_ok"],
        )
    from tpulab.proofs.transformer import prove_transformer_resume

    v = prove_transformer_resume(
        config,
        args.run_dir,
        kill_at=args.kill_at,
        skip_restore=tuple(args.skip_restore),
        **proof_children(args),
    )
    v = ResumeVerdict.from_dict(v)
    return verdict_exit(
        v,
        f"{v.summary}; killed ({v.signal}) after step {v.kill_step}, resumed from step "
        f"{v.resumed_from_step} -> {RunDir(args.run_dir).proof}",
    )


def cmd_chaos(args) -> int:
    config = load_run_config(args)
    from tpulab.proofs.chaos import run_chaos

    v = run_chaos(
        config,
        args.run_dir,
        kills=args.kills,
        seed=args.seed,
        **proof_children(args),
    )
    v = ResumeVerdict.from_dict(v)
    d = v.details
    return verdict_exit(
        v,
        f"{d['kills']} random SIGKILLs ({d['kills_during_save']} while a save was in flight), "
        f"{d['segments']} process lifetimes; {v.summary} -> {RunDir(args.run_dir).chaos}",
    )


def cmd_sft_eval(args) -> int:
    from tpulab.errors import TpulabError

    out = args.out if args.out is not None else args.run_dir / "sft_eval.json"
    from tpulab.checkpoint.files import check_out, json_with

    check_out(out, file=True, reuse=json_with("models", "stop"))  # its own record: replaced
    merged = checked_path(args.merged, "--merged") if args.merged is not None else None
    for flag, value in (("--max-new", args.max_new), ("--prompts", args.prompts)):
        if value is not None and value < 1:
            raise TpulabError(f"{flag} {value} must be at least 1")
    from tpulab.checkpoint.files import atomic_write_json
    from tpulab.posttrain.evaluate import TRAINED, evaluate_sft

    r = evaluate_sft(args.run_dir, merged=merged, max_new=args.max_new, prompts=args.prompts)
    atomic_write_json(out, r)
    base, sft, stop = r["models"]["base"], r["models"][TRAINED], r["stop"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    print(
        f"held-out response loss {base['response_loss']:.4f} (base) -> {sft['response_loss']:.4f}; "
        f"stop within {stop['max_new']} bytes {pct(base['stop_rate'])} -> "
        f"{pct(sft['stop_rate'])} (reference {pct(stop['reference_rate'])}) over "
        f"{stop['prompts']} prompts -> {out}"
    )
    return ExitCode.OK


def cmd_check(args) -> int:
    config = load_run_config(args)
    from tpulab.proofs.checks import print_table, run_checks

    results = run_checks(config, run_dir=args.run_dir)
    print_table(results)
    return ExitCode.OK if all(r["passed"] for r in results) else ExitCode.FAILED


def cmd_capstone(args) -> int:
    config = load_run_config(args)
    from tpulab.orchestrate.capstone import CapstoneOptions, run_capstone

    report = run_capstone(
        config,
        args.out,
        from_flags(CapstoneOptions, args),  # --skip-* and --chaos-kills, --compile-cache
    )
    print(f"report: {report} and {report.with_suffix('.html')}")
    from tpulab.evidence.goodput import goodput

    proof_run = RunDir(args.out).proof.interrupted.root
    if proof_run.is_dir():
        g = goodput(proof_run)
        print(
            f"goodput of the resume proof's killed-and-resumed run: {100 * g['goodput']:.1f}% of "
            f"{g['total_s']:.1f} s over {len(g['lifetimes'])} process lifetimes "
            f"({g['restart_s']:.1f} s lost to the restart; details in the report)"
        )
    return ExitCode.OK


def cmd_merge_lora(args) -> int:
    from tpulab.train.merge import merge_lora

    r = merge_lora(args.run_dir, args.out)
    if r.get("reused"):
        print(
            f"{args.out} already holds the merge of step {r['step']}'s adapters (checkpoint "
            f"{r['merged_checkpoint_digest'][:12]}); nothing written"
        )
        return ExitCode.OK
    print(
        f"merged {r['adapted_matrices']} adapted matrices of step {r['step']} in "
        f"{r['merge_seconds']:.3f} s; merged logits within {r['max_relative_logit_diff']:.2g} "
        f"(relative) of the adapter model's -> {args.out} "
        f"(checkpoint {r['merged_checkpoint_digest'][:12]})"
    )
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train what the config names (resumes from the newest valid checkpoint in --run-dir)",
    )
    add_run_dir(p)
    add_config_args(p)
    p.add_argument(
        "--force", action="store_true", help="resume even if the config or corpus changed"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--skip-restore", action="append", default=[], help=argparse.SUPPRESS
    )  # negative controls
    p.add_argument(
        "--hold-after-step", type=int, help=argparse.SUPPRESS
    )  # the proof driver's fixed kill point
    p.add_argument("--cache-stats", type=Path, help=argparse.SUPPRESS)  # the proof driver's
    add_tracking_args(p)
    p.add_argument(
        "--init-timeout",
        type=int,
        default=120,
        help="seconds every process of a multi-process job "
        "has to reach the coordinator (default 120)",
    )
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser(
        "prove-resume", help="reference run, SIGKILL'd run, fresh-process resume, overlaid curves"
    )
    add_run_dir(p)
    add_config_args(p)
    p.add_argument(
        "--kill-at",
        type=int,
        help="SIGKILL the second run right after this step (default: between "
        "checkpoints, about 60%% of the way)",
    )
    p.add_argument("--skip-restore", action="append", default=[], help=argparse.SUPPRESS)
    add_proof_children_args(p)
    p.add_argument(
        "--processes",
        type=int,
        help="prove it on a launched multi-process job: SIGKILL one process",
    )
    p.add_argument(
        "--devices-per-process", type=int, default=2, help="with --processes: host devices each"
    )
    p.add_argument(
        "--stall",
        action="store_true",
        help="with --processes: SIGSTOP one process instead; the "
        f"others' step watchdog must end the job (exit {int(ExitCode.STALLED)})",
    )
    p.add_argument(
        "--stall-timeout", type=float, default=10.0, help="with --processes: watchdog timeout (s)"
    )
    p.set_defaults(handler=cmd_prove_resume)

    p = sub.add_parser(
        "chaos", help="SIGKILL a run at random moments, resume each time, compare the whole state"
    )
    add_run_dir(p)
    add_config_args(p)
    p.add_argument(
        "--kills", type=int, default=5, help="random SIGKILLs before the run may finish (default 5)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    add_proof_children_args(p)
    p.set_defaults(handler=cmd_chaos)

    p = sub.add_parser(
        "merge-lora", help="fold a LoRA run's adapters into its base: a plain model run dir"
    )
    add_run_dir(p, "the LoRA run")
    p.add_argument("--out", required=True, type=path_arg, help="run dir to write the model to")
    p.set_defaults(handler=cmd_merge_lora)

    p = sub.add_parser(
        "sft-eval",
        help="an SFT run against its base on the held-out plays: response loss, stop rate, samples",
    )
    add_run_dir(p, "the SFT (or LoRA) run")
    p.add_argument("--merged", type=path_arg, help="its merge-lora output, compared too")
    p.add_argument(
        "--max-new",
        type=int,
        help="N: a generation stops in time if it emits ETX within N bytes (default: a quarter "
        "of the context)",
    )
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts to generate from")
    p.add_argument("--out", type=path_arg, help="JSON record (default: RUN_DIR/sft_eval.json)")
    p.set_defaults(handler=cmd_sft_eval)

    p = sub.add_parser(
        "check", help="independent checks (causality, valid-token loss, disjoint data) as a table"
    )
    add_run_dir(p, "check this run's trained weights and data (default: fresh init)", False)
    add_config_args(p)
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser(
        "capstone", help="the main job: train, prove the resume, run the checks, write report.md"
    )
    p.add_argument("--out", required=True, type=path_arg)
    add_config_args(p)
    p.add_argument("--skip-bridge", action="store_true", help="leave out the PyTorch bridge stage")
    p.add_argument(
        "--skip-inference", action="store_true", help="leave out the KV-cache and export stage"
    )
    p.add_argument(
        "--chaos-kills",
        type=int,
        default=3,
        help="random kills in the chaos stage (0 leaves it out)",
    )
    p.add_argument(
        "--skip-scaleout", action="store_true", help="leave out the 2-process kill/resume stage"
    )
    p.add_argument(
        "--skip-dossier", action="store_true", help="leave out the decision dossier stage"
    )
    p.add_argument(
        "--skip-posttrain",
        action="store_true",
        help="leave out the post-training stage (SFT and LoRA, merge, evaluation)",
    )
    p.set_defaults(handler=cmd_capstone)
