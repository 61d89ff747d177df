"""`tpulab` command line: parse arguments, call one library function, TpulabError -> one line.

Each concern registers its own subcommands (``register(subparsers)``) so this file stays a thin
dispatcher. Every handler is named ``cmd_<subcommand>`` (``tests/test_architecture.py``). Heavy
imports (jax, torch) happen inside the handlers, so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import sys

from tpulab.errors import ExitCode, TpulabError


def build_parser() -> argparse.ArgumentParser:
    from tpulab.cli import (
        bridge_cmds,
        cloud_cmds,
        inference_cmds,
        ops_cmds,
        ops_image_cmds,
        perf_cmds,
        posttrain_cmds,
        scale_cmds,
        seeds_cmds,
        track_cmds,
        train_cmds,
    )

    parser = argparse.ArgumentParser(
        prog="tpulab",
        description="Train small models on whatever backend JAX sees, with evidence you can check: "
        "full-state checkpoints, kill/resume proofs, exported endpoints, provenance.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        train_cmds,
        scale_cmds,
        bridge_cmds,
        inference_cmds,
        perf_cmds,
        cloud_cmds,
        track_cmds,
        ops_cmds,
        ops_image_cmds,
        posttrain_cmds,
        seeds_cmds,
    ):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tpulab.process_setup import prepare

    prepare()  # before any jax import: host allocator and libtpu settings (tpulab.process_setup)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from tpulab.cli.args import check_paths

        return int(args.handler(check_paths(args)) or ExitCode.OK)
    except TpulabError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
