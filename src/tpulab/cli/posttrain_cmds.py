"""Post-training stages that generate: ``tpulab pairs`` (sampled preference pairs), ``tpulab
win-rate`` (gold-reward win rate of greedy replies) and ``tpulab posttrain`` (the preference chain
from an SFT run: pairs, reward model, DPO and PPO, with its report section); and ``tpulab probe``
(a pretrained image encoder read by a linear probe, against a CNN and the raw pixels)."""

from __future__ import annotations

import json
from pathlib import Path

from tpulab.cli.args import DEFAULT_CONFIG, add_config_args, checked_path, from_flags, path_arg
from tpulab.errors import ExitCode


def cmd_pairs(args) -> int:
    from tpulab import compile_cache
    from tpulab.posttrain.pairs import PairsConfig, make_pairs, summary_line

    compile_cache.enable()
    cfg = from_flags(PairsConfig, args)
    record = make_pairs(checked_path(args.policy, "--policy"), args.out, cfg)
    print(summary_line(record))
    print(f"wrote {args.out}/pairs.jsonl, eval.jsonl, dataset.json")
    return ExitCode.OK


def cmd_win_rate(args) -> int:
    from tpulab import compile_cache
    from tpulab.checkpoint.files import atomic_write_json, check_out, json_with
    from tpulab.posttrain.winrate import win_rate

    if args.out is not None:  # an earlier win-rate record is replaced; any other file is in the way
        check_out(args.out, file=True, reuse=json_with("policy", "against", "win_rate"))
    compile_cache.enable()
    result = win_rate(
        args.run_dir,
        checked_path(args.against, "--against"),
        args.max_prompts,
    )
    if args.out is not None:
        atomic_write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("prompts", "wins", "ties", "losses", "win_rate")}))
    return ExitCode.OK


def cmd_posttrain(args) -> int:
    from tpulab import compile_cache
    from tpulab.orchestrate.chain import run_chain

    cache = compile_cache.enable(args.compile_cache)
    run_chain(checked_path(args.sft, "--sft"), args.out, compile_cache=cache)
    print(f"wrote {args.out}/chain.md and chain.json")
    return ExitCode.OK


def cmd_probe(args) -> int:
    from tpulab.cli.args import load_run_config
    from tpulab.posttrain.probe import PROBE_JSON, ProbeConfig, run_probe, summary_lines

    cfg = from_flags(ProbeConfig, args)
    if args.config is None:
        args.config = DEFAULT_CONFIG.parent / "digits_cnn.yaml"
    record = run_probe(
        checked_path(args.encoder, "--encoder"), args.out, load_run_config(args), cfg
    )
    for line in summary_lines(record):
        print(line)
    print(f"wrote {args.out}/{PROBE_JSON}")
    return ExitCode.OK


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "pairs",
        help="sample two replies per prompt from a policy, label them Bradley-Terry on the gold "
        "reward, write DIR/pairs.jsonl, eval.jsonl and dataset.json",
    )
    p.add_argument("--policy", type=path_arg, required=True, help="the policy's run dir (SFT)")
    p.add_argument("--out", type=path_arg, required=True, help="a new (or empty) directory")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and the prompt choice)")
    p.add_argument("--labeller-seed", type=int, default=0, help="the Bradley-Terry draws' seed")
    p.add_argument("--train-prompts", type=_count, default=1024, help="at most N; 0 = all")
    p.add_argument("--eval-prompts", type=_count, default=256, help="at most N; 0 = all")
    p.set_defaults(handler=cmd_pairs)

    p = sub.add_parser(
        "win-rate",
        help="gold-reward win rate of a policy's greedy replies on the held-out prompts against "
        "another policy's (ties count half)",
    )
    p.add_argument("--run-dir", type=path_arg, required=True, help="the policy (e.g. DPO)")
    p.add_argument("--against", type=path_arg, required=True, help="the baseline (e.g. SFT)")
    p.add_argument("--max-prompts", type=_count, default=0, help="the first N prompts; 0 = all")
    p.add_argument("--out", type=path_arg, default=None, help="write the whole result as JSON")
    p.set_defaults(handler=cmd_win_rate)

    p = sub.add_parser(
        "posttrain",
        help="the preference chain from an SFT run at the demo's size: tpulab pairs, a reward "
        "model, DPO (also killed and resumed) and PPO, then DIR/chain.md with curves, the "
        "gold-vs-proxy table, win rates, the identity table and the resume verdict",
    )
    p.add_argument("--sft", type=path_arg, required=True, help="the SFT run dir")
    p.add_argument("--out", type=path_arg, required=True, help="a new (or empty) directory")
    p.add_argument("--compile-cache", type=Path, help="JAX persistent compilation cache dir")
    p.set_defaults(handler=cmd_posttrain)

    p = sub.add_parser(
        "probe",
        help="a linear probe on a pretrained image encoder's frozen features (digits_mae), against "
        "a CNN (--config, default configs/digits_cnn.yaml) and logistic regression on the raw "
        "pixels, each over --seeds seeds with a 95%% interval; writes DIR/probe.json",
    )
    p.add_argument("--encoder", type=path_arg, required=True, help="the pretraining run dir")
    p.add_argument("--out", type=path_arg, required=True, help="a new (or empty) directory")
    p.add_argument("--seeds", type=int, default=5, help="seeds per model (at least 2)")
    p.add_argument("--epochs", type=int, default=60, help="passes of each linear model")
    add_config_args(p)
    p.set_defaults(handler=cmd_probe)
