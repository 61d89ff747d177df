"""``tpulab probe``: a linear probe on a frozen pretrained image encoder, read against a supervised
CNN and against logistic regression on the raw pixels, each over several seeds with a 95% interval.

The encoder is a finished run whose model has ``features(images) -> [n, d]`` (``digits_mae``: the
MAE encoder with every patch visible, tokens mean-pooled). Everything is measured on the held-out
images of the encoder run's own recorded partition (recomputed from its config and checked against
the digest its checkpoint names: pretraining never saw them), and trained on its training images:

- ``mae_linear_probe``: softmax regression on the frozen features;
- ``pixels_logistic_regression``: the same trainer on the 64 raw pixels;
- ``cnn``: a ``digits_cnn`` run (``cnn``, its run config) per seed, through the one training
  loop, on the same partition; its held-out accuracy from the restored model.

Seed ``s`` sets the linear models' initialisation and minibatch order and the CNN run's ``seed``
and ``data.shuffle_seed``; the partition stays the encoder's. The interval is Student's t over the
seeds: mean +- t(0.975, n-1) * sd / sqrt(n). Both linear models standardise their inputs by the
training images' mean and deviation, and are trained identically (``ProbeConfig``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tpulab.checkpoint.files import atomic_write_json, check_out
from tpulab.config import check, check_int, field
from tpulab.data import digits
from tpulab.errors import TpulabError
from tpulab.evidence.provenance import environment
from tpulab.train.config import RunConfig
from tpulab.train.loop import train
from tpulab.train.objectives.digits_cnn import DigitsCNN
from tpulab.train.registry import objective_class
from tpulab.train.restore import Restored, load_model

PROBE_JSON = "probe.json"


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """The linear models' trainer and the seeds every model is run over."""

    seeds: int = field(5, "seeds per model (at least 2 for an interval; 5 for the issue's)")
    epochs: int = field(60, "passes over the training images of each linear model")
    batch_size: int = field(128, "minibatch of the linear models")
    lr: float = field(1e-2, "Adam learning rate of the linear models")
    weight_decay: float = field(1e-4, "decoupled weight decay of the linear models")

    def __post_init__(self):
        check_int(self.seeds, "--seeds", 2, 1000, "an interval needs at least 2")
        check_int(self.epochs, "--epochs", 1, 100_000)
        check_int(self.batch_size, "probe batch_size", 1, 1437)
        check(self.lr > 0, f"probe lr={self.lr} must be positive")
        check(self.weight_decay >= 0, f"probe weight_decay={self.weight_decay} must be >= 0")


def interval(values: list[float]) -> dict:
    """Mean, sample deviation and the 95% Student-t interval of ``values`` (n >= 2)."""
    from scipy.stats import t

    a = np.asarray(values, np.float64)
    n, mean, sd = len(a), float(a.mean()), float(a.std(ddof=1))
    half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {
        "accuracy_mean": mean,
        "accuracy_sd": sd,
        "interval_95": [mean - half, mean + half],
        "accuracies": [float(v) for v in a],
    }


def linear_trainer(cfg: ProbeConfig, n_train: int):
    """A jitted (train_x, train_y, test_x, test_y, key) -> held-out accuracy: softmax regression
    from a small random init, ``cfg.epochs`` seeded shuffles of ``cfg.batch_size`` minibatches
    (the remainder of each shuffle left out), AdamW."""
    tx = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = max(1, n_train // cfg.batch_size)
    size = min(cfg.batch_size, n_train)

    def xent(params, x, y):
        logits = x @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def run(train_x, train_y, test_x, test_y, key):
        mean, sd = train_x.mean(0), train_x.std(0) + 1e-6
        a, b = (train_x - mean) / sd, (test_x - mean) / sd
        init_key, order_key = jax.random.split(key)
        w = 0.01 * jax.random.normal(init_key, (a.shape[1], digits.CLASSES))
        params = {"w": w, "b": jnp.zeros((digits.CLASSES,))}
        orders = jax.vmap(lambda k: jax.random.permutation(k, n_train))(
            jax.random.split(order_key, cfg.epochs)
        )
        batches = orders[:, : per_epoch * size].reshape(-1, size)

        def step(carry, idx):
            params, opt = carry
            grads = jax.grad(xent)(params, a[idx], train_y[idx])
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), batches)
        return ((b @ params["w"] + params["b"]).argmax(-1) == test_y).mean()

    return jax.jit(run)


def encoder_features(restored: Restored, x: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(restored.model)
    features = jax.jit(lambda s, images: nnx.merge(graphdef, s).features(images))
    return np.asarray(features(state, x))


def open_encoder(encoder_dir: Path) -> tuple[Restored, digits.DigitsPartition]:
    """The encoder run and its partition, recomputed and checked; one line for a run that is not
    a digits encoder, or whose partition is not the one it recorded."""
    restored = load_model(encoder_dir)
    kind = restored.config.objective.kind
    if not callable(getattr(restored.model, "features", None)):
        raise TpulabError(f"{encoder_dir} is a {kind} run: its model has no encoder to probe")
    if getattr(restored.config.model, "image_size", None) != digits.IMAGE_SIZE:
        raise TpulabError(f"{encoder_dir} is a {kind} run, not a model of the 8x8 digits")
    part = digits.partition(restored.config.data)
    from tpulab.checkpoint.store import read_meta

    recorded = read_meta(restored.checkpoint_dir).get("identities", {}).get("digits_partition")
    if recorded != part.identity:
        raise TpulabError(
            f"{encoder_dir} recorded digits partition {str(recorded)[:12]}…, its config now "
            f"gives {part.identity[:12]}…: the held-out images are not the ones it never saw"
        )
    return restored, part


def supervised_config(cnn: RunConfig, encoder: RunConfig, seed: int) -> RunConfig:
    """The CNN run of seed ``seed``: the encoder's partition, this seed's init and order."""
    data = dataclasses.replace(
        cnn.data,
        split_seed=encoder.data.split_seed,
        val_fraction=encoder.data.val_fraction,
        shuffle_seed=seed,
    )
    return dataclasses.replace(cnn, seed=seed, data=data)


def run_probe(encoder_dir: str | Path, out: str | Path, cnn: RunConfig, cfg: ProbeConfig) -> dict:
    """Every model over ``cfg.seeds`` seeds; writes ``out/probe.json`` (and the CNN runs under
    ``out/cnn/seed-<s>``) and returns its record. Nothing is written before every input is
    checked."""
    if not issubclass(objective_class(cnn.objective.kind), DigitsCNN):
        raise TpulabError(
            f"the supervised reference is a {DigitsCNN.kind} run config, not "
            f"objective.kind={cnn.objective.kind}"
        )
    out = check_out(out)
    restored, part = open_encoder(Path(encoder_dir))
    x, y = digits.load()
    held, trained = part.eval, part.train
    seeds = list(range(cfg.seeds))
    wall: dict[str, float] = {}

    t0 = time.monotonic()
    features = encoder_features(restored, x)
    pixels = x.reshape(len(x), -1)
    fit = linear_trainer(cfg, len(trained))
    linear = {}
    for name, inputs in (("mae_linear_probe", features), ("pixels_logistic_regression", pixels)):
        accs = [
            float(fit(inputs[trained], y[trained], inputs[held], y[held], jax.random.PRNGKey(s)))
            for s in seeds
        ]
        linear[name] = {"features": int(inputs.shape[1]), **interval(accs)}
    wall["linear_models"] = time.monotonic() - t0

    t0 = time.monotonic()
    runs, accs = [], []
    for s in seeds:
        run_dir = out / "cnn" / f"seed-{s}"
        train(supervised_config(cnn, restored.config, s), run_dir, progress=False)
        logits = load_model(run_dir).model(x[held])
        accs.append(float((np.asarray(logits).argmax(-1) == y[held]).mean()))
        runs.append(str(run_dir))
    wall["cnn_runs"] = time.monotonic() - t0

    record: dict[str, Any] = {
        "encoder": {
            "run_dir": str(encoder_dir),
            "objective": restored.config.objective.kind,
            "step": restored.step,
            "checkpoint_digest": restored.checkpoint_digest,
            "feature_dim": int(features.shape[1]),
        },
        "partition": part.describe(),
        "held_out_images": int(len(held)),
        "train_images": int(len(trained)),
        "seeds": seeds,
        "interval": "mean +- t(0.975, n-1) * sd / sqrt(n) over the seeds",
        "probe_config": dataclasses.asdict(cfg),
        "models": {
            **linear,
            "cnn": {"runs": runs, "steps": cnn.train.steps, **interval(accs)},
        },
        "wall_s": {k: round(v, 2) for k, v in wall.items()},
        "environment": environment(),
    }
    atomic_write_json(out / PROBE_JSON, record)
    return record


def summary_lines(record: dict) -> list[str]:
    """One line per model: mean accuracy and its interval."""
    return [
        f"{name}: {m['accuracy_mean']:.4f} [{m['interval_95'][0]:.4f}, {m['interval_95'][1]:.4f}]"
        f" over {len(m['accuracies'])} seeds"
        for name, m in record["models"].items()
    ]
