"""tpulab: train small models on whatever backend JAX sees, with evidence you can check.

The public face, imported lazily (PEP 562) so ``import tpulab`` stays cheap and imports no jax:

    config = tpulab.load_config("configs/tiny.yaml", ["train.steps=40"])
    summary = tpulab.fit(config, "runs/a")
    restored = tpulab.load_model("runs/a")  # .model, .config, .step, .checkpoint_digest

Everything else lives in the subpackages (``tpulab.train``, ``tpulab.inference``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tpulab.lazy import lazy_exports

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig

# name -> "module:attribute". ``fit`` is the loop's ``train``: a package attribute named ``train``
# would be replaced by the subpackage ``tpulab.train`` the moment anything imports it (the import
# system binds a loaded submodule to its parent's attribute), so no public name here equals a
# submodule's (tests/test_package_face.py checks every face for that).
_EXPORTS = {
    "RunConfig": "tpulab.train.config:RunConfig",
    "fit": "tpulab.train.loop:train",
    "Hooks": "tpulab.train.hooks:Hooks",
    "load_model": "tpulab.train.restore:load_model",
    "Objective": "tpulab.train.objective:Objective",
    "DataSource": "tpulab.train.objective:DataSource",
    "register_objective": "tpulab.train.registry:register_objective",
    "register_family": "tpulab.model.families:register_family",
    "Steps": "tpulab.train.step:Steps",
    "TrainState": "tpulab.train.step:TrainState",
    "gradient_steps": "tpulab.train.step:gradient_steps",
    "objective_class": "tpulab.train.registry:objective_class",
    "TpulabError": "tpulab.errors:TpulabError",
    "ExitCode": "tpulab.errors:ExitCode",
}

__all__ = sorted([*_EXPORTS, "load_config"])


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A run's config: the defaults, then the YAML file at ``path``, then ``key=value`` overrides
    (the CLI's ``--set``). An unknown key or a bad value raises ``ConfigError`` naming it."""
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    return load(RunConfig, path, list(overrides))


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
