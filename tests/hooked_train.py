"""Test-only child trainer: `tpulab train` with test hooks injected (never imported by src/).

    python tests/hooked_train.py --config C --run-dir D [--withhold-commit S] [--hold-commit S]
        [--nan-at S] [--hold-after-step K] [--hang-at S] [--stall-timeout T]
        [--stall-startup-timeout U] [--stall-exit]

--withhold-commit S: checkpoint S is saved but never gets its completion marker, as if the process
died while the async save was in flight. --hold-commit S: checkpoint S's save is held open (Orbax
wrote it, the marker never comes) and the process stays alive, for a kill that lands mid-save.
--nan-at S: step S's loss and parameters turn NaN on the device. --hang-at S: the training thread
blocks forever right after step S was dispatched (an injected hang for the stall watchdog, which
--stall-timeout T [--stall-startup-timeout U]
[--stall-exit] installs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from tpulab.config import load
from tpulab.errors import ExitCode
from tpulab.train.config import RunConfig
from tpulab.train.hooks import HoldAfter, Hooks
from tpulab.train.loop import train


class WithholdCommit(Hooks):
    def __init__(self, step: int):
        self.step = step

    def allow_commit(self, step):
        return step != self.step


class HoldCommit(Hooks):
    """Holds checkpoint ``step``'s save open: Orbax has written it, its completion marker never
    comes and the process stays alive (the store's committer blocks here): a kill lands mid-save."""

    def __init__(self, step: int):
        self.step = step

    def allow_commit(self, step):
        while step == self.step:
            time.sleep(3600)
        return True


class NanAt(Hooks):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, step, state, metrics):
        if step != self.step:
            return state, metrics
        poison = lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else x  # noqa: E731
        return state._replace(params=jax.tree.map(poison, state.params)), {
            **metrics,
            "loss": metrics["loss"] * jnp.nan,
        }


class HangAt(Hooks):
    """Blocks before step ``step``'s numbers are ever read: nothing after step-1 is logged."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, step, state, metrics):
        if step == self.step:
            while True:
                time.sleep(3600)
        return state, metrics


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compile-cache", type=Path)
    p.add_argument("--withhold-commit", type=int)
    p.add_argument("--hold-commit", type=int)
    p.add_argument("--nan-at", type=int)
    p.add_argument("--hold-after-step", type=int)
    p.add_argument("--hang-at", type=int)
    p.add_argument("--cache-stats", type=Path)  # the proof driver's, as `tpulab train`
    p.add_argument("--stall-timeout", type=float)
    p.add_argument("--stall-startup-timeout", type=float)
    p.add_argument("--stall-exit", action="store_true")
    args = p.parse_args()
    if args.cache_stats:
        from tpulab.proofs.cache import record_cache_events

        record_cache_events(args.cache_stats)
    hooks = []
    if args.withhold_commit:
        hooks.append(WithholdCommit(args.withhold_commit))
    if args.hold_commit:
        hooks.append(HoldCommit(args.hold_commit))
    if args.nan_at:
        hooks.append(NanAt(args.nan_at))
    if args.hold_after_step:
        hooks.append(HoldAfter(args.hold_after_step))
    if args.hang_at:
        hooks.append(HangAt(args.hang_at))
    if args.stall_timeout:
        from tpulab.train.watchdog import STARTUP_S, StallWatchdog

        hooks.append(
            StallWatchdog(
                args.run_dir,
                timeout_s=args.stall_timeout,
                startup_s=args.stall_startup_timeout or STARTUP_S,
                exit_code=ExitCode.STALLED if args.stall_exit else None,
            )
        )
    from tpulab.errors import TpulabError

    try:
        train(
            load(RunConfig, args.config, args.overrides),
            args.run_dir,
            progress=False,
            compile_cache_dir=args.compile_cache,
            hooks=hooks,
        )
    except TpulabError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
