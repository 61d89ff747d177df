"""Environment throughput: CartPole steps/s of tpulab.envs at 256 environments, random actions,
one jitted scan, and gymnax's CartPole-v1 under the same scan when gymnax is importable.

    python benchmarks/env_throughput.py [--envs 256] [--steps 1000] [--repeats 20] \
        [--out benchmarks/results/env_throughput]

Prints a Markdown table; with --out writes OUT.json (raw per-call times, provenance) and OUT.md.
gymnax is not a tpulab dependency: without it the table says so. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _tpulab_case(num_envs: int, num_steps: int):
    import jax

    from tpulab.envs import init_rollout, make, rollout

    env = make("cartpole")
    params = env.default_params()

    def random_policy(policy_params, key, obs_n4):
        return jax.random.randint(key, obs_n4.shape[:1], 0, env.num_actions)

    carry = [init_rollout(env, jax.random.key(0), num_envs, params)]

    def call():
        carry[0], transitions = rollout(env, random_policy, num_steps, None, carry[0], params)
        return transitions

    return call


def _gymnax_case(num_envs: int, num_steps: int):
    """The same loop over gymnax's environment: vmapped step (its own auto-reset), random actions,
    ``lax.scan`` over steps, the per-step outputs stacked, all in one jitted function."""
    import gymnax
    import jax

    env, params = gymnax.make("CartPole-v1")
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    @jax.jit
    def run(carry):
        def one_step(carry, _):
            state, obs, key = carry
            key, key_act, key_step = jax.random.split(key, 3)
            action = jax.random.randint(key_act, (num_envs,), 0, 2)
            keys = jax.random.split(key_step, num_envs)
            out = step_envs(keys, state, action, params)
            # gymnax 1.0.1 (PyPI) returns (obs, state, reward, done, info); its main branch
            # returns terminated and truncated apart, as tpulab does.
            next_obs, state, reward = out[:3]
            done = out[3] | out[4] if len(out) == 6 else out[3]
            return (state, next_obs, key), (obs, action, reward, done)

        return jax.lax.scan(one_step, carry, None, length=num_steps)

    key, reset_key = jax.random.split(jax.random.key(0))
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, num_envs), params
    )
    carry = [(state, obs, key)]

    def call():
        carry[0], transitions = run(carry[0])
        return transitions

    return call


def _measure(cases: dict, num_envs: int, num_steps: int, repeats: int) -> list[dict]:
    """Each case's first call (trace, compile, run), then ``repeats`` rounds timing one call of
    each, the order rotated every round, so a shared host's load shifts hit every case alike."""
    import jax

    from tpulab.perf.timing import summarize, time_steps

    first, times = {}, {name: [] for name in cases}
    for name, call in cases.items():
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        first[name] = time.perf_counter() - t0
    names = list(cases)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name] += time_steps(cases[name], jax.block_until_ready, 1)
    rows = []
    for name in names:
        summary = summarize(times[name])
        steps = num_envs * num_steps
        rows.append(
            {
                "impl": name,
                "first_call_s": first[name],
                "times_s": times[name],
                **summary,
                "steps_per_s_median": steps / summary["median_s"],
                "steps_per_s_p10_p90": [steps / summary["p90_s"], steps / summary["p10_s"]],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1000, help="scan length of one call")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls (at least 20)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()  # as the CLI does, before JAX starts its threads or a backend
    from tpulab.evidence import report_kit
    from tpulab.evidence.provenance import describe_hardware, package_versions
    from tpulab.perf.timing import benchmark_environment

    cases = {"tpulab.envs": _tpulab_case}
    try:
        import gymnax

        cases["gymnax"] = _gymnax_case
        # Which gymnax ran: the installed distribution's version, or the source tree it came from.
        version = package_versions(("gymnax",))["gymnax"]
        gymnax_note = f"gymnax: {version or 'no installed distribution'}, from {gymnax.__file__}"
    except ImportError as e:
        gymnax_note = f"gymnax: not measured, `import gymnax` failed ({e})"

    load_before = [round(x, 2) for x in os.getloadavg()]
    calls = {name: make_case(args.envs, args.steps) for name, make_case in cases.items()}
    rows = _measure(calls, args.envs, args.steps, args.repeats)
    env = benchmark_environment(extra_packages=("gymnax",))
    head = (
        f"{describe_hardware(env)}; jax {env['packages']['jax']}; commit {env['git_commit']}; "
        f"CartPole, {args.envs} environments, random actions, {args.steps} steps per jitted "
        f"scan, median of {args.repeats} interleaved calls; load average {load_before} before, "
        f"{env['load_avg_1m_5m_15m']} after, on {os.cpu_count()} host cores"
    )
    table = report_kit.table(
        ["implementation", "env steps/s (median)", "p10-p90", "s per call", "first call s"],
        [
            [
                r["impl"],
                f"{r['steps_per_s_median'] / 1e6:.2f}M",
                "-".join(f"{v / 1e6:.2f}M" for v in r["steps_per_s_p10_p90"]),
                f"{r['median_s']:.4f}",
                f"{r['first_call_s']:.2f}",
            ]
            for r in rows
        ],
    )
    text = [head, "", table, "", gymnax_note]
    print("\n".join(text))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "rows": rows,
            "gymnax": gymnax_note,
            "config": vars(args) | {"out": str(args.out)},
            "environment": env,
            "load_avg_before": load_before,
        }
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
