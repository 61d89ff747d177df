"""``tpulab seeds``: train N seeds of a config (and of a second one, on the same seeds), score each
on held-out episodes, write DIR/seeds.json and the report (``tpulab.orchestrate.seeds``)."""

from __future__ import annotations

from tpulab.cli.args import add_config_args, load_run_config, path_arg
from tpulab.errors import ExitCode


def cmd_seeds(args) -> int:
    from tpulab import compile_cache, load_config
    from tpulab.cli.args import checked_path
    from tpulab.orchestrate.seeds import run_seeds, seed_count, summary_line

    seed_count(args.seeds)  # before the configs load and anything is imported
    config = load_run_config(args)
    compare = None
    if args.compare is not None:
        compare = load_config(checked_path(args.compare, "--compare"), list(args.overrides))
    compile_cache.enable(args.compile_cache)
    record = run_seeds(
        config,
        args.seeds,
        args.out,
        compare=compare,
        mode="sequence" if args.sequence else "vmapped",
        target=args.target,
    )
    print(summary_line(record))
    print(f"wrote {args.out}/seeds.json, seeds.md, report.md")
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser(
        "seeds",
        help="train N seeds, score each greedy policy on held-out episodes, report the IQM with "
        "a 95%% stratified-bootstrap interval (DIR/seeds.json, report.md)",
    )
    add_config_args(p)
    p.add_argument("--seeds", required=True, help="how many seeds (seed, seed + 1, ...)")
    p.add_argument("--out", type=path_arg, required=True, help="a new (or empty) directory")
    p.add_argument(
        "--compare",
        type=path_arg,
        help="a second config trained on the same seeds (the same --set): probability of "
        "improvement of --config over it",
    )
    p.add_argument(
        "--sequence",
        action="store_true",
        help="one run per seed instead of the seeds vmapped in one run",
    )
    p.add_argument("--target", type=float, default=475.0, help="the return to time (default 475)")
    p.set_defaults(handler=cmd_seeds)
