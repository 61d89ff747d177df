"""One step builder: every objective's update is ``step.Update`` and every objective's jitted steps
are ``step.compile_steps``; no objective takes gradients, applies an optimizer or jits its own
train step. PPO's and pretraining's numbers are checked elsewhere (``test_ppo.py``,
``test_pretrain_golden.py``); this file checks the structure and the piece itself."""

from __future__ import annotations

import ast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import REPO, tiny_config
from tpulab.train.step import TrainState, Update, initial_state

TRAIN = REPO / "src" / "tpulab" / "train"
# what building a train step means: taking gradients, applying an optimizer, jitting with donation
STEP_CALLS = {"value_and_grad", "grad", "apply_updates", "clip_by_global_norm"}


def step_building(source: str) -> list[str]:
    """``name:line`` of every call that builds a train step by itself: gradients, an optimizer
    applied or a clip, or a ``jax.jit`` with donated arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        donates = name == "jit" and any(k.arg == "donate_argnums" for k in node.keywords)
        if name in STEP_CALLS or donates:
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_objective_builds_its_own_step():
    builders = {
        str(p.relative_to(TRAIN)): step_building(p.read_text())
        for p in sorted(TRAIN.rglob("*.py"))
        if step_building(p.read_text())
    }
    assert list(builders) == ["step.py"], builders
    # control: PPO's step as it was before the builder was shared is caught
    old_ppo = """
def train_step(self, state, frozen, batch, behaviour):
    (value, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(state.params, rnd, rows)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
train = jax.jit(self.train_step, donate_argnums=0)
"""
    assert sorted(step_building(old_ppo)) == ["apply_updates:5", "jit:6", "value_and_grad:3"]


def test_an_update_takes_one_clipped_adamw_step_and_counts_it():
    """``Update`` on a quadratic against optax by hand: the same params and optimizer state to
    the bit, the step counted, the record's shared keys and the loss's own; other state fields
    (the key) are the caller's, untouched."""
    cfg = tiny_config("optim.clip_norm=0.5", "optim.warmup_steps=1")

    def loss(params, target):
        return jnp.sum((params["w"] - target) ** 2), {"rows": jnp.int32(3)}

    update = Update.of(loss, cfg.optim)
    params = {"w": jnp.arange(4.0)}
    state = initial_state(update.tx, params, cfg.seed)._replace(step=jnp.int32(2))
    target = jnp.full((4,), 10.0)
    new, metrics = jax.jit(update)(state, target)

    grads = jax.grad(lambda p: loss(p, target)[0])(params)
    updates, opt_state = update.tx.update(grads, state.opt_state, params)
    want = optax.apply_updates(params, updates)
    assert np.array_equal(new.params["w"], want["w"])
    assert jax.tree.all(jax.tree.map(np.array_equal, new.opt_state, opt_state))
    assert int(new.step) == 3 and np.array_equal(new.rng, state.rng)
    assert isinstance(new, TrainState) and set(metrics) == {"loss", "grad_norm", "lr", "rows"}
    assert np.isclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)))
    assert float(metrics["lr"]) == float(update.schedule(2))  # the schedule at the step taken
    # the clip is the chain's first link: Adam's first moment holds the clipped gradients
    g = grads["w"]
    mu = optax.tree_utils.tree_get(new.opt_state, "mu")["w"]
    b1 = cfg.optim.b1
    assert np.allclose(mu, (1 - b1) * g * 0.5 / jnp.linalg.norm(g), rtol=1e-6)
    # control: without the clip the same check fails (the first moment holds g itself)
    plain = Update.of(loss, tiny_config("optim.clip_norm=0", "optim.warmup_steps=1").optim)
    unclipped, _ = jax.jit(plain)(initial_state(plain.tx, params, 0)._replace(step=2), target)
    mu_plain = optax.tree_utils.tree_get(unclipped.opt_state, "mu")["w"]
    assert np.allclose(mu_plain, (1 - b1) * g, rtol=1e-6)
    assert not np.allclose(mu_plain, (1 - b1) * g * 0.5 / jnp.linalg.norm(g), rtol=1e-6)


def test_every_objective_state_starts_from_the_same_four_fields():
    """PPO's state is the shared four fields plus its round: the same key and optimizer state
    as a one-loss objective's from the same params and seed."""
    from tpulab.train.objectives.ppo_state import PPOState

    assert PPOState._fields[:4] == TrainState._fields
    cfg = tiny_config()
    update = Update.of(lambda p: (jnp.sum(p["w"]), {}), cfg.optim)
    first = initial_state(update.tx, {"w": jnp.ones(3)}, cfg.seed)
    assert np.array_equal(first.rng, jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1))
    # control: another seed gives another key
    other = initial_state(update.tx, {"w": jnp.ones(3)}, cfg.seed + 1)
    assert not np.array_equal(first.rng, other.rng)
