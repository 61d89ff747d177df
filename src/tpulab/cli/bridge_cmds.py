"""`tpulab bridge ...`: the small MLP through a PyTorch-to-XLA bridge (train, prove-resume,
compare); `tpulab convert`: the byte Transformer to its PyTorch twin and back."""

from __future__ import annotations

import argparse
from pathlib import Path

from tpulab.checkpoint.rundir import ResumeVerdict, RunDir
from tpulab.cli.args import (
    add_children_no_track_arg,
    add_proof_children_args,
    add_run_dir,
    checked_path,
    path_arg,
    verdict_exit,
)
from tpulab.errors import ExitCode

BACKEND_HELP = (
    "torch (plain PyTorch on CPU, the reference), torchax (torch on JAX), torch_xla (TPU VMs only)"
)
METHOD_HELP = (
    "eager (torch autograd + torch.optim.Adam) or jit (torchax only: functional jitted step, "
    "optax.adam)"
)


def _config_args(p: argparse.ArgumentParser, steps_default: int | None = None) -> None:
    import dataclasses

    from tpulab.bridge.config import BridgeConfig, cli_flag

    g = p.add_argument_group("run config (defaults in brackets)")
    for f in dataclasses.fields(BridgeConfig):
        default = steps_default if (f.name == "steps" and steps_default) else f.default
        g.add_argument(
            cli_flag(f.name),
            dest=f"cfg_{f.name}",
            type=type(f.default),
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['doc']} [{default}]",
        )
    p.set_defaults(_steps_default=steps_default)


def _config(args):
    from tpulab.bridge.config import BridgeConfig
    from tpulab.config import from_dict

    values = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    if args._steps_default and "steps" not in values:
        values["steps"] = args._steps_default
    return from_dict(BridgeConfig, values)


def register(sub) -> None:
    bridge = sub.add_parser(
        "bridge",
        help="the small MLP trained through a PyTorch-to-XLA bridge",
        description=__doc__.splitlines()[0],
    )
    bsub = bridge.add_subparsers(dest="bridge_command", required=True, metavar="SUBCOMMAND")

    p = bsub.add_parser("train", help="train (or resume) one run in --run-dir")
    p.add_argument("--backend", required=True, help=BACKEND_HELP)
    p.add_argument("--method", default="eager", help=METHOD_HELP + " [eager]")
    add_run_dir(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="load a checkpoint from another backend/method/config anyway",
    )
    p.add_argument(
        "--no-restore-rng", dest="restore_rng", action="store_false", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--hold-after-step", type=int, help=argparse.SUPPRESS
    )  # the proof driver's fixed kill point
    p.add_argument("--cache-stats", type=Path, help=argparse.SUPPRESS)  # the proof driver's
    _config_args(p)
    from tpulab.cli.args import add_tracking_args

    add_tracking_args(p, stall=False)
    p.set_defaults(handler=cmd_train)

    p = bsub.add_parser(
        "prove-resume", help="reference run, SIGKILL'd run, fresh-process resume, exact comparison"
    )
    p.add_argument("--backend", required=True, help=BACKEND_HELP)
    p.add_argument("--method", default="eager", help=METHOD_HELP + " [eager]")
    add_run_dir(p)
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="SIGKILL the run right after this step [between two checkpoints, past the middle]",
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds allowed per child process [600]"
    )
    p.add_argument(
        "--no-restore-rng", dest="restore_rng", action="store_false", help=argparse.SUPPRESS
    )
    add_proof_children_args(p, reference=False, trainer="bridge train")
    _config_args(p)
    p.set_defaults(handler=cmd_prove_resume)

    p = bsub.add_parser(
        "compare", help="train the same seed and shapes on every available backend and method"
    )
    add_run_dir(p)
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds allowed per child process [600]"
    )
    add_children_no_track_arg(p, "bridge train")
    _config_args(p)
    p.set_defaults(handler=cmd_compare)
    _register_convert(sub)


def _register_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="a trained byte Transformer to its PyTorch twin (or back), checked layer by layer",
        description="--run-dir D --to torch --out T.pt: the run's newest verified model as a "
        "self-describing torch file; --from torch T.pt --out D: that file back as a run dir "
        "load_model verifies. Each prints its per-layer table (docs/interop.md); a layer over "
        "its fp32 bound, or a greedy generation that differs, fails it with nothing written.",
    )
    add_run_dir(p, "the run to convert (its newest verified checkpoint)", required=False)
    p.add_argument("--to", choices=("torch",), help="the format to write")
    p.add_argument(
        "--from",
        dest="source",
        nargs=2,
        metavar=("FORMAT", "FILE"),
        help="convert FILE (FORMAT: torch, a file `tpulab convert --to torch` wrote) to a run dir",
    )
    p.add_argument("--out", required=True, type=path_arg, help="the file or run dir to write")
    p.set_defaults(handler=cmd_convert)


def cmd_convert(args) -> int:
    from tpulab.errors import TpulabError

    if (args.source is None) == (args.to is None) or (args.source is None) != (
        args.run_dir is not None
    ):
        raise TpulabError("give either --run-dir D --to torch, or --from torch FILE (not both)")
    from tpulab.bridge import convert
    from tpulab.bridge.layers import markdown

    if args.source is not None:
        fmt, file = args.source
        if fmt != "torch":
            raise TpulabError(f"--from {fmt}: the format must be torch")
        r = convert.from_torch_file(checked_path(file, "--from FILE"), args.out)
        what = f"run dir {args.out} (step {r['step']}, checkpoint {r['checkpoint_digest'][:12]})"
    else:
        r = convert.to_torch_file(args.run_dir, args.out)
        what = f"torch file {args.out}"
    g = r["greedy"]
    print(markdown(r))
    print(
        f"converted {r['source']} -> {'torch' if r['source'] == 'tpulab' else 'tpulab'}: every "
        f"layer within its fp32 bound; greedy generations equal on {g['prompts']} held-out "
        f"prompts x {g['new_tokens']} bytes; {r['seconds']:.2f} s -> {what}"
    )
    return ExitCode.OK


def cmd_train(args) -> int:
    from tpulab.bridge.loop import train
    from tpulab.cli.args import tracker_for
    from tpulab.config import to_dict
    from tpulab.train.hooks import HoldAfter

    cfg = _config(args)
    if args.cache_stats and args.backend != "torch":  # torch alone compiles nothing through JAX
        from tpulab.proofs.cache import record_cache_events

        record_cache_events(args.cache_stats)
    tracker = tracker_for(
        args,
        args.run_dir,
        kind="bridge",
        params={**to_dict(cfg), "backend": args.backend, "method": args.method},
        extra_tags={"tpulab.backend": args.backend, "tpulab.bridge.method": args.method},
    )
    hooks = ([tracker] if tracker else []) + (
        [HoldAfter(args.hold_after_step)] if args.hold_after_step else []
    )
    out = train(  # closes every hook: a tracker's MLflow run ends FAILED when this raises
        cfg,
        args.backend,
        args.method,
        args.run_dir,
        force=args.force,
        restore_rng=args.restore_rng,
        hooks=hooks,
    )
    how = (
        f"resumed from step {out.resumed_from}" if out.resumed_from is not None else "from scratch"
    )
    print(
        f"trained {args.backend}/{args.method} to step {out.final_step} ({how}); "
        f"run dir {args.run_dir}"
    )
    return ExitCode.OK


def cmd_prove_resume(args) -> int:
    from tpulab.bridge.prove import prove

    v = prove(
        _config(args),
        args.backend,
        args.method,
        args.run_dir,
        kill_at=args.kill_at,
        restore_rng=args.restore_rng,
        timeout_s=args.timeout,
        warm_resume_cache=args.warm_resume_cache,
        track=not args.no_track,
    )
    v = ResumeVerdict.from_dict(v)
    return verdict_exit(  # as `tpulab prove-resume`: FAILED whenever not identical
        v,
        f"{v.summary}; killed after step {v.kill_step}, resumed from {v.resumed_from_step}; "
        f"see {RunDir(args.run_dir).proof}",
        subject=f"{args.backend}/{args.method}",
    )


def cmd_compare(args) -> int:
    from tpulab.bridge.compare import compare

    result = compare(_config(args), args.run_dir, timeout_s=args.timeout, track=not args.no_track)
    print(result["markdown"])
    return ExitCode.OK
