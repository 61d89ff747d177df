"""Decode speed: compiled loop vs step loop vs recomputation, and compiled-loop tokens/s vs batch
per cache.

    python benchmarks/decode_speed.py --run-dir runs/demo/run [--prompt-lens 16 64] \
        [--new-tokens 32] [--batches 1 8 32] [--out benchmarks/results/decode_speed_demo]

Prints Markdown tables; with --out writes OUT.json (raw rows + provenance: backend, device, dtypes,
shapes, versions, commit) and OUT.md (the tables as the docs quote them).
A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    # The summary paragraph; argparse re-wraps it, so its line break does not show in --help.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--cache", choices=("fp32", "bf16", "int8"), default="fp32")
    parser.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=[1, 8, 32],
        help="batch sizes for the per-cache table (none: skip it)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()  # as the CLI does, before JAX starts its threads or a backend
    from tpulab.evidence.provenance import describe_hardware, environment
    from tpulab.inference.speed import batch_markdown, batch_table, decode_speed, speed_table
    from tpulab.model.transformer import built_param_count
    from tpulab.train.restore import load_model

    restored = load_model(args.run_dir, args.step)
    load_before = os.getloadavg()
    rows = decode_speed(
        restored,
        tuple(args.prompt_lens) if args.prompt_lens else None,
        args.new_tokens,
        policy=args.cache,
        repeats=args.repeats,
    )
    env = environment()
    m = restored.config.model
    head = (
        f"{describe_hardware(env)}; jax {env['packages']['jax']}; commit {env['git_commit']}; "
        f"model d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"max_seq_len {m.max_seq_len}, {built_param_count(restored.model):,} parameters, "
        f"{restored.config.precision.compute_dtype} compute; checkpoint step {restored.step}; "
        f"batch 1, greedy, best of {args.repeats}; load average before "
        f"{load_before[0]:.1f} on {os.cpu_count()} host cores"
    )
    text = [head, "", f"Cache {args.cache}:", "", speed_table(rows)]
    batch_rows = []
    if args.batches:
        batch_rows = batch_table(restored, tuple(args.batches), repeats=args.repeats)
        r0 = batch_rows[0]
        text += [
            "",
            f"Compiled loop, tokens/s against batch ({r0['prompt_len']}-token prompts, "
            f"{r0['new_tokens']} new tokens per row, greedy):",
            "",
            batch_markdown(batch_rows),
        ]
    print("\n".join(text))
    result = {
        "rows": rows,
        "batch_rows": batch_rows,
        "environment": env,
        "hardware": describe_hardware(env),
        "checkpoint_step": restored.step,
        "run_dir": str(args.run_dir),
        "model": vars(m),
        "parameters": built_param_count(restored.model),
        "precision": vars(restored.config.precision),
        "repeats": args.repeats,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        Path(f"{args.out}.md").write_text("\n".join(text) + "\n")
        print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
    main()
