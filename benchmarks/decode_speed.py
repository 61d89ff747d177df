"""Decode speed: cached decode vs recomputing the full forward for every token, at two prompt lengths.

    python benchmarks/decode_speed.py --run-dir runs/demo/run [--prompt-lens 16 64] [--new-tokens 32]

Prints a Markdown table and a JSON line with provenance (backend, device, dtypes, shapes, versions).
A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--cache", choices=("fp32", "bf16", "int8"), default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tpulab.evidence.provenance import describe_hardware, environment
    from tpulab.inference.speed import decode_speed, speed_table
    from tpulab.train.restore import load_model

    restored = load_model(args.run_dir, args.step)
    rows = decode_speed(restored, tuple(args.prompt_lens) if args.prompt_lens else None, args.new_tokens,
                        policy=args.cache, repeats=args.repeats)
    env = environment()
    print(f"{describe_hardware(env)}; checkpoint step {restored.step}")
    print(speed_table(rows))
    print(json.dumps({"rows": rows, "environment": env, "checkpoint_step": restored.step,
                      "model": vars(restored.config.model), "precision": vars(restored.config.precision)}))


if __name__ == "__main__":
    main()
