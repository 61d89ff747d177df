"""Model families: the run config's ``model`` section is the typed config of the family its
``family`` key names (``transformer`` when absent, so every config written before families existed
reads as it did).

A family is a config dataclass with a ``family`` field, registered with ``register_family`` and a
``param_count(config)`` (what the host-memory check sizes the train state by, from the config
alone). The built-ins register in the modules of ``BUILTINS`` (imported on the first lookup): the
``transformer`` in ``tpulab.model.config``, the image models ``cnn`` and ``mae_vit`` in their own
files; a family outside ``tpulab`` is named by its import path, ``model.family:
package.module:Config``, so a proof's fresh child processes import it again from their config.yaml.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from tpulab.config import import_named
from tpulab.errors import ConfigError

# name -> the module that registers it, imported when the name is first looked up (the image
# models import flax: a run of another family never pays for them)
BUILTINS = {
    "transformer": "tpulab.model.config",
    "cnn": "tpulab.model.cnn",
    "mae_vit": "tpulab.model.mae",
}
DEFAULT_FAMILY = "transformer"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: type
    param_count: Callable[[Any], int]  # trainable parameters of a model of this config


_FAMILIES: dict[str, Family] = {}


def register_family(name: str, param_count: Callable[[Any], int]) -> Callable[[type], type]:
    """Class decorator: register the config dataclass as family ``name``."""

    def register(cls: type) -> type:
        if "family" not in {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"{cls.__qualname__} has no field 'family': not a model family")
        held = _FAMILIES.get(name)
        if held is not None and held.config.__qualname__ != cls.__qualname__:
            raise ConfigError(f"model family {name!r} is registered twice")
        _FAMILIES[name] = Family(name, cls, param_count)
        return cls

    return register


def registered() -> dict[str, Family]:
    for module in BUILTINS.values():
        importlib.import_module(module)
    return dict(_FAMILIES)


def family(name: str) -> Family:
    """The family ``name`` names: registered, or ``package.module:Config``; else one line."""
    if isinstance(name, str) and name in BUILTINS:
        importlib.import_module(BUILTINS[name])
        return _FAMILIES[name]
    known = registered()
    if isinstance(name, str) and name in known:
        return known[name]
    if not isinstance(name, str) or ":" not in name:
        raise ConfigError(
            f"model.family={name!r} is not registered (registered: {', '.join(known)}; or name "
            "your own as package.module:Config)"
        )
    cls = import_named("model.family", name)
    found = [f for f in registered().values() if f.config is cls]
    if not found:
        raise ConfigError(f"model.family={name!r} is no registered family's config")
    return found[0]


def section_of(name: str) -> tuple[str, type]:
    return name, family(name).config


def sections() -> dict[str, type]:
    return {n: f.config for n, f in registered().items()}
