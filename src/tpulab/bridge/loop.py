"""The bridge trainer: the same seed, data and MLP on any backend, with full-state checkpoints.

Data: x ~ N(0, 1) of shape (n, d) from a torch.Generator seeded with ``seed``; y = x.sum(1,
keepdim=True). Every step trains on the whole fixed set; with ``augment`` > 0 it trains on
x + augment * noise, the noise drawn each step from a second generator (``seed + 1``). That
generator, torch's global CPU generator (dropout on the torch backend) and the device generator
(torchax's jax key, XLA's seed) are all saved in every checkpoint and restored on resume; the
hidden ``restore_rng=False`` negative control leaves them out, so a resumed run redraws from the
seeds and its curve must differ from the reference.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from tpulab.bridge import checkpoint as C
from tpulab.bridge.backends import build_model, make_runner, torch_xla_problem
from tpulab.bridge.config import DTYPE, BridgeConfig, check_backend_method
from tpulab.checkpoint.rundir import RunSummary
from tpulab.config import to_dict
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import MetricsLog
from tpulab.evidence.provenance import package_versions
from tpulab.train.hooks import HookList, Hooks


def make_data(cfg: BridgeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    x_nd = torch.randn(cfg.n, cfg.d, generator=g, dtype=torch.float32)
    return x_nd, x_nd.sum(dim=1, keepdim=True)


def versions() -> dict:
    return package_versions(("torch", "torchax", "jax", "jaxlib", "optax", "torch_xla"))


def train(
    cfg: BridgeConfig,
    backend: str,
    method: str,
    run_dir: str | Path,
    *,
    force: bool = False,
    restore_rng: bool = True,
    hooks: list[Hooks] | tuple[Hooks, ...] = (),
) -> RunSummary:
    """Train ``cfg.steps`` steps in ``run_dir``, resuming from its newest checkpoint; a summary.

    ``hooks`` (the proof's hold, trackers) are called as the Transformer trainer calls them, all
    on this thread: ``on_start`` once, ``on_metrics`` after each logged step (at once: a torch
    step is synchronous), ``on_checkpoint`` after each save (saves are synchronous and atomic, so
    there is no ``allow_commit``), ``on_end`` when the run finishes. There is no ``after_step``
    (the state is torch's, not a pytree to replace) and no ``on_eval`` (no validation set).

    Every check that can refuse the run (backend, method, torch_xla, checkpoint integrity and
    identity) happens before anything is written to ``run_dir``. Every hook's ``close()`` is
    called once when this returns or raises.
    """
    hooks = HookList(hooks)
    try:
        return _train(cfg, backend, method, run_dir, force, restore_rng, hooks)
    finally:
        hooks.close()


def _train(
    cfg: BridgeConfig,
    backend: str,
    method: str,
    run_dir: str | Path,
    force: bool,
    restore_rng: bool,
    hooks: HookList,
) -> RunSummary:
    check_backend_method(backend, method)
    if backend == "torch_xla" and (problem := torch_xla_problem()):
        raise TpulabError(problem)
    run_dir = Path(run_dir)
    # The MLP is tiny: a second intra-op thread only adds synchronisation (20x slower per step on a
    # busy 2-core machine). One thread also keeps CPU reductions in one fixed order.
    torch.set_num_threads(1)
    state, resumed_from, forced = None, None, []
    ckpt = C.latest(run_dir) if run_dir.is_dir() else None
    if ckpt is not None:
        meta = C.read_meta(ckpt)
        forced = C.check_identity(meta, ckpt, backend, method, cfg, force)
        state = C.load_state(ckpt)
        resumed_from = int(state["step"])

    x_nd, y_n1 = make_data(cfg)
    aug = torch.Generator().manual_seed(cfg.seed + 1)
    model = build_model(
        cfg
    )  # always rebuilt from scratch; the checkpoint then overwrites its weights
    runner = make_runner(backend, method, cfg, model, y_n1, state)
    if state is not None and "rng" in state:
        torch.set_rng_state(state["rng"]["torch_cpu"])
        aug.set_state(state["rng"]["augment"])

    run_dir.mkdir(parents=True, exist_ok=True)
    device = runner.describe()
    info = {
        "backend": backend,
        "method": method,
        "config": to_dict(cfg),
        "dtype": DTYPE,
        "device": device,
        "versions": versions(),
        "restore_rng": restore_rng,
    }
    if backend == "torchax":
        from tpulab.bridge import torchax_compat

        info["torchax_workarounds"] = list(torchax_compat.APPLIED)
    log = MetricsLog(run_dir, resumed_from=resumed_from, forced=forced or None, **info)
    meta = {
        "format": 1,
        "backend": backend,
        "method": method,
        "config": to_dict(cfg),
        "dtype": DTYPE,
        "versions": info["versions"],
        "rng_saved": restore_rng,
    }
    start = resumed_from or 0
    last_ckpt, last_saved, loss = ckpt, resumed_from, None
    times = []
    hooks.on_start(
        {
            "run_dir": str(run_dir),
            "config": cfg,
            "start_step": start,
            "total_steps": cfg.steps,
            "process_index": 0,
            "resumed_from": resumed_from,
            "checkpoint_digest": None,
            "env": {"backend": backend, "method": method, "device": device, **info["versions"]},
        }
    )
    try:
        for step in range(start + 1, cfg.steps + 1):
            x_step = (
                x_nd + cfg.augment * torch.randn(x_nd.shape, generator=aug) if cfg.augment else x_nd
            )
            t0 = time.perf_counter()
            loss = runner.step(x_step)
            dt = time.perf_counter() - t0
            times.append(dt)
            if not math.isfinite(loss):
                raise TpulabError(
                    f"loss is {loss} at step {step}; last good checkpoint: {last_ckpt}"
                )
            log.log(step, loss=loss, step_time_s=dt)
            record = {"loss": loss, "step_time_s": dt}
            saved = step % cfg.checkpoint_every == 0 or step == cfg.steps
            if saved:
                full = runner.state(with_rng=restore_rng)
                if restore_rng:
                    full["rng"] = {"torch_cpu": torch.get_rng_state(), "augment": aug.get_state()}
                last_ckpt, last_saved = C.save(run_dir, step, full, meta), step
            hooks.on_metrics(step, record)
            if saved:
                hooks.on_checkpoint(step)
        log.event("done", step=cfg.steps)
    finally:
        log.close()
    summary = RunSummary(
        final_step=cfg.steps,
        latest_checkpoint=last_saved,
        final_loss=loss,
        resumed_from=resumed_from,
        start_step=start,
        step_times_s=times,
    )
    hooks.on_end(summary)
    return summary
