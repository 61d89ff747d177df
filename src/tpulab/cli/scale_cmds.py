"""Scale-out subcommands: launch (P local processes on JAX's distributed runtime) and reshard."""

from __future__ import annotations

import argparse
from pathlib import Path

from tpulab.errors import ExitCode


def cmd_launch(args) -> int:
    from tpulab.orchestrate.launch import launch

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    return launch(
        command,
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        log_dir=args.log_dir,
        grace_s=args.grace,
    )


def parse_mesh(text: str):
    """``data=2,fsdp=1`` -> MeshConfig; one-line errors."""
    from tpulab.config import from_dict
    from tpulab.errors import ConfigError
    from tpulab.train.config import MeshConfig

    values = {}
    for part in filter(None, text.split(",")):
        key, sep, raw = part.partition("=")
        if not sep or not raw.strip().isdigit():
            raise ConfigError(f"--mesh expects data=N,fsdp=M, got '{text}'")
        values[key.strip()] = int(raw)
    return from_dict(MeshConfig, values)


def cmd_reshard(args) -> int:
    if args.processes and args.processes > 1:
        from tpulab.orchestrate.launch import launch

        mesh = parse_mesh(args.mesh)  # bad input fails here, before any process starts
        per = (mesh.data * mesh.fsdp) // args.processes if mesh.data else 1
        if not mesh.data or per * args.processes != mesh.data * mesh.fsdp:
            from tpulab.errors import ConfigError

            raise ConfigError(
                f"--mesh {args.mesh} does not split evenly over --processes {args.processes}"
            )
        return launch(
            [
                "reshard",
                "--run-dir",
                str(args.run_dir),
                "--out",
                str(args.out),
                "--mesh",
                args.mesh,
                *(["--step", str(args.step)] if args.step is not None else []),
            ],
            processes=args.processes,
            devices_per_process=per,
            log_dir=Path(args.out) / "launch",
        )
    mesh = parse_mesh(args.mesh)
    from tpulab.train.distributed import initialize_from_env
    from tpulab.train.reshard import reshard

    initialize_from_env()
    result = reshard(Path(args.run_dir), Path(args.out), mesh, args.step)
    print(
        f"resharded step {result['step']} from {result['from']} onto {result['to']}: "
        f"{result['leaves']} leaves bitwise equal after gathering -> {result['out']} "
        f"(continue: tpulab train --run-dir {args.out} ...)",
        flush=True,
    )
    return ExitCode.OK


def cmd_prove_layouts(args) -> int:
    from tpulab.cli.args import load_run_config

    config = load_run_config(args)
    from tpulab.proofs.scaleout import prove_layouts

    v = prove_layouts(config, Path(args.run_dir))
    print((Path(args.run_dir) / "layouts.md").read_text(), end="")
    return ExitCode.OK if v["passed"] else ExitCode.FAILED


def cmd_prove_reshard(args) -> int:
    from tpulab.cli.args import load_run_config

    config = load_run_config(args)
    from tpulab.checkpoint.rundir import ReshardVerdict
    from tpulab.proofs.scaleout import prove_reshard

    v = ReshardVerdict.from_dict(prove_reshard(config, Path(args.run_dir), at_step=args.at_step))
    c, r = v.continued_vs_reference, v.reshard
    print(
        f"{'PASSED' if v.passed else 'FAILED'}: restored state bitwise equal "
        f"({r['leaves']} leaves, {r['from']} -> {r['to']}); "
        f"continued curve vs 2-process reference: max rel diff {c['max_rel_diff']:.2e} over "
        f"{c['steps']} steps (rtol {v.rtol:g}) -> {Path(args.run_dir) / 'overlay.png'}"
    )
    return ExitCode.OK if v.passed else ExitCode.FAILED


def register(sub) -> None:
    from tpulab.cli.args import add_config_args, add_run_dir

    p = sub.add_parser(
        "prove-layouts", help="same run on 1x1, 1 proc x 4 dev and 2 proc x 2 dev: loss table"
    )
    add_run_dir(p)
    add_config_args(p)
    p.set_defaults(handler=cmd_prove_layouts)

    p = sub.add_parser(
        "prove-reshard", help="2 proc x 2 dev checkpoint resharded onto 1 proc x 2 dev, trained on"
    )
    add_run_dir(p)
    add_config_args(p)
    p.add_argument("--at-step", type=int, required=True, help="reshard the checkpoint of this step")
    p.set_defaults(handler=cmd_prove_reshard)

    p = sub.add_parser(
        "launch",
        help="run a tpulab command in P local processes on JAX's distributed runtime",
        description="Start P processes on loopback (coordinator on a free port, gloo CPU "
        "collectives, K host devices each), stream process 0's output, forward SIGTERM/SIGINT, "
        "and tear everything down within --grace seconds if any process dies. Exit "
        f"{int(ExitCode.STALLED)}: a process's step watchdog found the job stalled; "
        f"{int(ExitCode.PEER_FAILED)}: a process died or failed.",
    )
    p.add_argument("--processes", type=int, required=True, help="number of processes")
    p.add_argument(
        "--devices-per-process", type=int, default=1, help="host devices per process (default 1)"
    )
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--log-dir", type=Path, help="per-process logs and launch.json (default: RUN_DIR/launch)"
    )
    p.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL at teardown"
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="-- then a tpulab command, e.g. -- train --run-dir DIR",
    )
    p.set_defaults(handler=cmd_launch)

    p = sub.add_parser(
        "reshard", help="move a checkpoint onto another mesh / process count, verified bitwise"
    )
    p.add_argument(
        "--run-dir", required=True, type=Path, help="run dir holding the checkpoint to move"
    )
    p.add_argument("--out", required=True, type=Path, help="new run dir (must not hold a run)")
    p.add_argument("--mesh", required=True, help="target mesh, e.g. data=1,fsdp=2")
    p.add_argument(
        "--processes", type=int, help="run the reshard itself in this many launched processes"
    )
    p.add_argument(
        "--step", type=int, help="checkpoint step to move (default: the newest valid one)"
    )
    p.set_defaults(handler=cmd_reshard)
