"""Performance and decision subcommands: budget, bench, profile."""

from __future__ import annotations

from pathlib import Path

from tpulab.cli.args import (
    add_config_args,
    add_repeatable,
    add_run_dir,
    load_run_config,
)
from tpulab.errors import ExitCode


def cmd_budget(args) -> int:
    config = load_run_config(args)
    from tpulab.perf.aot import parse_targets
    from tpulab.perf.budget import table, write_budget

    parse_targets(args.target)  # a bad name fails before any heavy work
    out = args.out or Path("runs") / "budget"
    result = write_budget(
        config, args.target, out, serve_batch=args.serve_batch, serve_context=args.serve_context
    )
    print(table(result))
    print(f"wrote {out}/budget.json, budget.md, budget.png")
    return ExitCode.OK


def cmd_bench(args) -> int:
    from tpulab.config import load
    from tpulab.perf.bench import summary_table, sweep_configs, sweep_table
    from tpulab.train.config import RunConfig

    config = load_run_config(args)
    sweep = None
    if args.sweep:  # every value validated before anything runs
        base = [*args.overrides]
        sweep = sweep_configs(
            lambda extra: load(RunConfig, args.config or _default_config(), base + extra),
            args.sweep,
        )
    from tpulab.perf.bench import parse_sweep, run_bench

    key = parse_sweep(args.sweep)[0] if args.sweep else None
    result = run_bench(config, args.run_dir, steps=args.timed_steps, sweep=sweep, sweep_key=key)
    print(summary_table(result["bench"]))
    if sweep:
        print(sweep_table(key, [(r["value"], r) for r in result["sweep"]["rows"]]))
    print(f"wrote {args.run_dir}/bench/bench.json, bench.md")
    return ExitCode.OK


def _default_config():
    from tpulab.cli.args import DEFAULT_CONFIG

    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def cmd_profile(args) -> int:
    from tpulab.perf.profile import markdown, profile_run

    result = profile_run(args.run_dir, steps=args.steps)
    print(markdown(result))
    print(f"wrote {args.run_dir}/profile/profile.json, profile.md and the trace")
    return ExitCode.OK


def cmd_precision(args) -> int:
    from tpulab.perf.precision import markdown, write_precision

    result = write_precision(args.run_dir)
    print(markdown(result))
    print(f"wrote {args.run_dir}/precision/precision.json, precision.md")
    return ExitCode.OK


def cmd_hypothesis(args) -> int:
    config = load_run_config(args)
    from tpulab.perf.hypothesis import markdown, predicted_change, run_hypothesis

    predicted_change(args.predict)  # fails fast, before any work
    result = run_hypothesis(
        config,
        args.change,
        args.predict,
        args.run_dir / "hypothesis",
        steps=args.steps_each,
        loss_tol=args.loss_tol,
    )
    print(markdown(result))
    print(f"wrote {args.run_dir}/hypothesis/hypothesis.json, hypothesis.md, hypothesis.png")
    return ExitCode.OK


def cmd_dossier(args) -> int:
    config = load_run_config(args)
    from tpulab.orchestrate.dossier import DossierPlan, build_dossier

    plan = DossierPlan(
        train_steps=args.train_steps,
        targets=args.target,
        target_overrides=tuple(args.target_set),
        batch_sweep=args.batch_sweep,
    )
    result = build_dossier(config, args.out, plan)
    print(f"dossier: {result['md']} and {result['html']}")
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="compile, first step and synchronized steady-state step time; "
        "utilization vs this host's matmul rate at the step's GEMM shapes",
    )
    add_run_dir(p, "results go to RUN_DIR/bench/")
    add_config_args(p)
    p.add_argument(
        "--timed-steps", type=int, default=20, help="synchronized steady-state steps (>= 20)"
    )
    p.add_argument(
        "--sweep", metavar="KEY=v1,v2,...", help="also bench each value of one config key"
    )
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser(
        "profile", help="trace K warmed train steps of a trained run; top-ops table from the trace"
    )
    add_run_dir(p, "a trained run (its newest checkpoint and config)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default: %(default)s)")
    p.set_defaults(handler=cmd_profile)

    p = sub.add_parser(
        "precision", help="fp32 / bf16 / int8 policies of a trained run against fp32, one table"
    )
    add_run_dir(p, "a trained fp32 run")
    p.set_defaults(handler=cmd_precision)

    p = sub.add_parser(
        "hypothesis", help="test one predicted speed-up: baseline and changed config side by side"
    )
    add_run_dir(p, "results go to RUN_DIR/hypothesis/")
    add_config_args(p)
    p.add_argument(
        "--change", required=True, metavar="KEY=VALUE", help="the config switch under test"
    )
    p.add_argument(
        "--predict",
        required=True,
        help="the prediction, ending in the signed step-time change (+N%% or -N%%), e.g. "
        "'dropout RNG is 20%% of the step; step time -20%%'",
    )
    p.add_argument(
        "--steps-each", type=int, default=30, help="train steps per side (default: %(default)s)"
    )
    p.add_argument(
        "--loss-tol", type=float, default=0.05, help="allowed |val loss difference| (nats)"
    )
    p.set_defaults(handler=cmd_hypothesis)

    p = sub.add_parser(
        "dossier",
        help="receipt, bench, profile, TPU budget, precision and a tested hypothesis: "
        "dossier.md + self-contained dossier.html",
    )
    p.add_argument("--out", required=True, type=Path)
    add_config_args(p)
    p.add_argument(
        "--train-steps",
        type=int,
        default=100,
        help="steps of the run that provides trained weights",
    )
    p.add_argument(
        "--batch-sweep",
        default="data.batch_size=8,16,32",
        help="the bench sweep (default: %(default)s)",
    )
    p.add_argument(
        "--target", default="v5e:2x2,v5p:2x2x1,v6e:2x2", help="TPU targets for the budget"
    )
    add_repeatable(
        p,
        "--target-set",
        "override for the target model of the budget (default: the run's model), repeatable",
    )
    p.set_defaults(handler=cmd_dossier)

    p = sub.add_parser(
        "budget",
        help="HBM budget per TPU target: analytic and compiled for the topology via libtpu",
    )
    add_config_args(p)
    p.add_argument(
        "--target",
        default="v5e:2x2,v5p:2x2x1,v6e:2x2",
        help="comma-separated GENERATION:TOPOLOGY targets (default: %(default)s)",
    )
    p.add_argument(
        "--serve-batch", type=int, default=8, help="sequences served at once (KV-cache budget)"
    )
    p.add_argument(
        "--serve-context", type=int, help="tokens per served sequence (default: model.max_seq_len)"
    )
    p.add_argument("--out", type=Path, help="where budget.json/md go (default: runs/budget)")
    p.set_defaults(handler=cmd_budget)
