"""The Transformer's kill/resume proof: `tpulab prove-resume` on top of the shared driver."""

from __future__ import annotations

from pathlib import Path

from tpulab.errors import TpulabError
from tpulab.evidence.proof import prove_resume


def default_kill_step(steps: int, save_every: int) -> int:
    """About 60% of the way, never on a checkpoint step, always after the first checkpoint."""
    k = max(int(0.6 * steps), save_every + 1)
    if k % save_every == 0:
        k += 1
    if k >= steps:
        raise TpulabError(f"{steps} steps leave no room to kill between checkpoints (checkpoint.save_every="
                          f"{save_every}); train longer or save more often")
    return k


def prove_transformer_resume(args, run_dir: Path, *, reference_dir: Path | None = None, kill_at: int | None = None,
                             skip_restore: tuple[str, ...] = ()) -> dict:
    """``args`` carries the config flags (--config, --set, --steps, --data, --compile-cache) the children get."""
    from tpulab.cli.train_cmds import child_train_argv, load_run_config

    config = load_run_config(args)
    steps = config.train.steps
    kill_at = kill_at or default_kill_step(steps, config.checkpoint.save_every)
    extra = [a for part in skip_restore for a in ("--skip-restore", part)]
    return prove_resume(lambda d: child_train_argv(args, d, extra), run_dir / "proof", steps=steps, kill_at=kill_at,
                        reference_dir=reference_dir, title="Transformer kill/resume",
                        extra={"skip_restore": list(skip_restore)})
