"""Load a trained model or whole state from a run dir's newest valid checkpoint, read-only.

For checks, inference, export, the proofs' whole-state verdicts and the objectives that start from
another run: nothing in the run dir is moved or written (a refused step stays where it is; only
training moves refused steps aside). A LoRA run's checkpoint holds its adapters; its base is read
from the run it started from and must be the checkpoint its digest names.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from tpulab.checkpoint.files import manifest_digest
from tpulab.checkpoint.rundir import RunDir
from tpulab.checkpoint.store import read_meta, read_state, scan
from tpulab.config import from_dict
from tpulab.errors import CheckpointError, TpulabError
from tpulab.train import sharding
from tpulab.train.config import RunConfig
from tpulab.train.registry import objective_class
from tpulab.train.step import TrainState, make_mesh, optimizer


@dataclasses.dataclass(frozen=True)
class Restored:
    model: Any  # the module the objective's model_from_params gives (a Transformer for the LMs)
    config: RunConfig
    step: int
    checkpoint_dir: Path
    checkpoint_digest: str  # sha256 of the checkpoint's manifest: names these exact weights
    state: TrainState
    base: Restored | None = None  # a LoRA run's frozen base (the run it started from)

    def plain_params(self) -> nnx.State:
        """The parameters of a plain Transformer computing what ``model`` computes (a LoRA run's
        adapters merged into its base; a PPO run's policy without its value head)."""
        return objective_class(self.config.objective.kind).plain_params(self)


def checkpoint_dir(run_dir: str | Path, step: int | None = None) -> Path:
    """The verified step dir (newest when ``step`` is None); one-line errors otherwise."""
    run_dir = Path(run_dir)
    ckpt_dir = RunDir(run_dir).checkpoints
    if not ckpt_dir.is_dir():
        raise TpulabError(
            f"{run_dir} holds no checkpoints (train first: tpulab train --run-dir {run_dir})"
        )
    found = scan(ckpt_dir)
    step = found.latest if step is None else step
    if step is None:
        raise CheckpointError(f"{ckpt_dir} holds no valid checkpoint")
    if not (ckpt_dir / str(step)).is_dir():
        raise CheckpointError(f"{ckpt_dir} has no checkpoint at step {step}")
    return ckpt_dir / str(step)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A run an objective reads (``objective.<key>``) whose newest step(s) fail verification, so
    it is read at an older verified step."""

    key: str  # init, reference or reward_model
    run_dir: str
    step: int  # the newest verified step, the one read
    skipped: tuple[tuple[int, str], ...]  # (step, why), newest first

    def line(self, refused: bool = False) -> str:
        skipped = ", ".join(f"step {n} skipped ({why})" for n, why in self.skipped)
        then = (
            f"refusing its older step {self.step} (objective.init_fallback=refuse)"
            if refused
            else f"using step {self.step}"
        )
        return f"{self.key} run {self.run_dir}: {skipped}; {then}"

    def record(self) -> dict:
        return {
            "key": self.key,
            "run_dir": self.run_dir,
            "step": self.step,
            "skipped": [{"step": n, "reason": why} for n, why in self.skipped],
            "warning": self.line(),
        }


def older_steps(config: RunConfig) -> list[Fallback]:
    """Read-only: each run ``objective.init`` / ``reference`` / ``reward_model`` names that
    ``checkpoint_dir`` would read at an older step than its newest (a run with no verified step
    at all is left to the loader's own one-line error)."""
    out, seen = [], set()
    for key in ("init", "reference", "reward_model"):
        run_dir = getattr(config.objective, key)
        if run_dir is None or Path(run_dir).absolute() in seen:
            continue
        seen.add(Path(run_dir).absolute())
        ckpts = RunDir(run_dir).checkpoints
        found = scan(ckpts) if ckpts.is_dir() else None
        if found is None or found.latest is None or not found.rejected:
            continue
        skipped = tuple(
            (r.step, f"{'incomplete' if r.incomplete else 'corrupt'}: {r.reason.splitlines()[0]}")
            for r in found.rejected
        )
        out.append(Fallback(key, str(run_dir), found.latest, skipped))
    return out


def check_older_steps(config: RunConfig) -> list[dict]:
    """``older_steps`` under ``objective.init_fallback``: refused in one line (refuse), else one
    ``warning:`` line each on stderr; their records, for env.json and the tracker."""
    fallbacks = older_steps(config)
    if fallbacks and config.objective.init_fallback == "refuse":
        raise CheckpointError(fallbacks[0].line(refused=True))
    for f in fallbacks:
        print(f"warning: {f.line()}", file=sys.stderr, flush=True)
    return [f.record() for f in fallbacks]


def load_model(run_dir: str | Path, step: int | None = None) -> Restored:
    """The run's newest verified (or the given) step, replicated on the devices here: the state
    its objective describes (``abstract_state``), in the model it describes."""
    step_dir = checkpoint_dir(run_dir, step)
    meta = read_meta(step_dir)
    config = from_dict(RunConfig, meta["config"])
    objective = objective_class(config.objective.kind)
    base = _lora_base(step_dir, meta, config) if config.objective.lora.rank else None
    abstract = objective.abstract_state(config, make_mesh())  # replicated, whatever mesh trained
    if meta.get("model_only"):  # a merged model (tpulab merge-lora): no optimizer state
        abstract = abstract._replace(opt_state=())
    state = read_state(step_dir, abstract)
    model = objective.model_from_params(
        config, state.params, None if base is None else base.plain_params()
    )
    return Restored(
        model, config, int(step_dir.name), step_dir, manifest_digest(step_dir), state, base
    )


def _lora_base(step_dir: Path, meta: dict, config: RunConfig) -> Restored:
    """The base a LoRA run adapts: the checkpoint its digest names, or a one-line refusal."""
    base = load_model(config.objective.init)
    want = meta.get("identities", {}).get("base")
    if base.checkpoint_digest != want:
        raise CheckpointError(
            f"{step_dir} adapts base {str(want)[:12]}…, but {config.objective.init} now holds "
            f"{base.checkpoint_digest[:12]}…; the adapters are refused on another base"
        )
    return base


def abstract_train_state(init_params, optim, mesh) -> TrainState:
    """Shapes and shardings of a TrainState over ``init_params()`` (traced, never computed)."""
    tx = optimizer(optim)

    def state():
        params = init_params()
        return TrainState(
            jax.numpy.zeros((), jax.numpy.int32), params, tx.init(params), jax.random.PRNGKey(0)
        )

    shapes = jax.eval_shape(state)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        shapes,
        sharding.state_shardings(shapes, mesh),
    )
