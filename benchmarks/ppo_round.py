"""A PPO round split into rollout, scoring and update time; rollout tokens/s, compiled vs step loop.

    python benchmarks/ppo_round.py --config configs/tiny.yaml --init RUN --reward-model RUN \
        [--set objective.ppo.rollouts=8 ...] [--rounds 3] [--out benchmarks/results/ppo_round_tiny]

Three measurements in one process, each after a warm-up that compiles it, synchronized per call:

- **the loop's own step** (``Steps.train``, one jitted program): a round's first step (rollouts,
  scoring, one update) against its other steps (one update), median over ``--rounds``;
- **the round's pieces**, each jitted alone on the same rollouts: rollout (``Fns.rollout``, the
  compiled generation loop), scoring (policy log-probs and values, the reference's log-probs, the
  reward model's score) and one update (a step at a position inside a round);
- **rollout tokens/s**: the compiled loop at the round's batch, and at batch 1 greedy against the
  step-by-step cached loop (``tpulab.inference.speed.measure``) at the round's prompt width.

Writes OUT.json (raw times, provenance, load average) and OUT.md. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from tpulab.evidence.report_kit import table


def timed(fn, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn())  # warm-up: compiles
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def render(result: dict) -> str:
    """OUT.md's two tables from OUT.json's ``row`` (the line above them names the live config and
    host, which OUT.json does not all hold)."""
    row = result["row"]
    ms = [f"{1e3 * row[k]:.1f}" for k in ("round_first_step_s", "round_other_step_s")]
    ms += [f"{1e3 * row[k]:.1f}" for k in ("rollout_s", "scoring_s", "round_s_estimate")]
    times = table(
        [
            "round's first step (rollout + scoring + update) ms",
            "other step (update) ms",
            "rollout alone ms",
            "scoring alone ms",
            "round ms (1 first + K-1 others)",
        ],
        [ms],
    )
    speed = table(
        [
            "rollout tokens/s (compiled loop, round batch)",
            "batch 1 compiled loop tok/s",
            "batch 1 step loop tok/s",
            "compiled / step",
            "same tokens",
        ],
        [
            (
                f"{row['rollout_tokens_per_s']:.0f}",
                f"{row['batch1_loop_tokens_per_s']:.0f}",
                f"{row['batch1_step_loop_tokens_per_s']:.0f}",
                f"{row['batch1_loop_vs_step']:.2f}x",
                row["batch1_same_tokens"],
            )
        ],
    )
    return f"{times}\n\n{speed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--reward-model", required=True)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()  # as the CLI does, before JAX starts its threads or a backend
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpulab.config import load, to_dict
    from tpulab.evidence.provenance import describe_hardware, environment
    from tpulab.inference.speed import measure
    from tpulab.model.decode import ModelFns
    from tpulab.train.config import RunConfig
    from tpulab.train.objectives import build
    from tpulab.train.objectives.ppo_state import policy_module
    from tpulab.train.step import make_mesh

    sets = [
        "objective.kind=ppo",
        f"objective.init={args.init}",
        f"objective.reward_model={args.reward_model}",
        *args.sets,
    ]
    cfg = load(RunConfig, args.config, sets)
    load_before = os.getloadavg()
    obj = build(cfg)
    steps = obj.steps(make_mesh(cfg))
    fns, z, p = obj.fns, obj.fns.z, cfg.objective.ppo
    it = obj.data().train(0, 1)
    state = steps.init()

    # the loop's own step, round after round
    first, inner = [], []
    state, m = steps.train(state, steps.put_batch(next(it)))  # warm-up: compiles, round 1
    jax.block_until_ready(m)
    for _ in range(z.per_round - 1):
        state, m = steps.train(state, steps.put_batch(next(it)))
    for _ in range(args.rounds):
        for k in range(z.per_round):
            batch = steps.put_batch(next(it))
            t0 = time.perf_counter()
            state, m = steps.train(state, batch)
            jax.block_until_ready(m)
            (first if k == 0 else inner).append(time.perf_counter() - t0)
    lengths_n = float(m["response_length"])

    # the round's pieces, jitted alone on one round's prompts
    params, frozen = state.params, steps.frozen
    batch = steps.put_batch(next(it))
    prompts = jnp.repeat(batch["inputs"], z.repeat, axis=0)
    lengths = jnp.repeat(batch["length"], z.repeat, axis=0)
    keys = jax.random.split(jax.random.PRNGKey(0), z.rollouts)
    max_new = jnp.full((z.rollouts,), z.max_new, jnp.int32)
    rollout = jax.jit(
        lambda prm, k: fns.rollout(prm["body"], prompts, lengths, k, p.temperature, max_new)
    )
    tokens, _, _, n = rollout(params, keys)
    read = lengths + n - 1

    def scoring(prm, fz, toks):
        logp, values, _ = fns.forward(prm, toks)
        return (
            logp,
            values,
            fns.ref_logp(fz["reference"], toks),
            fns.score(fz["reward"], toks, read),
        )

    score = jax.jit(scoring)
    t_rollout = timed(lambda: rollout(params, keys), args.repeats)
    t_score = timed(lambda: score(params, frozen, tokens), args.repeats)
    new_tokens = int(jnp.sum(n))

    # batch 1, greedy: the compiled loop against the step-by-step cached loop
    gen = ModelFns(policy_module(cfg, jax.device_get(params)))
    prompt_len = int(np.median(np.asarray(batch["length"])))
    b1 = measure(gen, prompt_len, z.max_new, repeats=args.repeats)

    med = statistics.median
    row = {
        "round_first_step_s": med(first),
        "round_other_step_s": med(inner),
        "rollout_s": med(t_rollout),
        "scoring_s": med(t_score),
        "update_s": med(inner),
        "round_s_estimate": med(first) + (z.per_round - 1) * med(inner),
        "rollout_new_tokens": new_tokens,
        "rollout_tokens_per_s": new_tokens / med(t_rollout),
        "batch1_loop_tokens_per_s": b1["loop_tokens_per_s"],
        "batch1_step_loop_tokens_per_s": b1["cached_tokens_per_s"],
        "batch1_loop_vs_step": b1["loop_vs_step"],
        "batch1_same_tokens": b1["same_tokens"],
        "batch1_prompt_len": prompt_len,
        "mean_response_length_last_round": lengths_n,
    }
    env = environment()
    md = cfg.model
    head = (
        f"{describe_hardware(env)}; jax {env['packages']['jax']}; commit {env['git_commit']}; "
        f"model d_model {md.d_model}, {md.n_layers} layers, seq_len {cfg.data.seq_len}, "
        f"{cfg.precision.compute_dtype} compute, rollout cache fp32; round: {z.rollouts} rollouts "
        f"of <= {z.max_new} new bytes for {z.prompts} prompts, {p.epochs} epochs x "
        f"{p.minibatches} minibatches; median of {args.rounds} rounds / {args.repeats} calls; "
        f"load average before {load_before[0]:.1f} on {os.cpu_count()} host cores"
    )
    text = [head, "", render({"row": row})]
    print("\n".join(text))
    result = {
        "row": row,
        "first_step_times_s": first,
        "other_step_times_s": inner,
        "rollout_times_s": t_rollout,
        "scoring_times_s": t_score,
        "batch1": b1,
        "config": to_dict(cfg),
        "environment": env,
        "hardware": describe_hardware(env),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        Path(f"{args.out}.md").write_text("\n".join(text) + "\n")
        print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
    main()
