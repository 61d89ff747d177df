"""The objective registry: ``objective.kind`` names a registered objective class, or imports one.

A kind is either a registered name (``pretrain``, ``dpo``: the built-ins register when
``tpulab.train.objectives`` is imported, which a lookup does first) or an import path
``package.module:Class``: the module is imported (its ``@register_objective`` runs) and the class
must subclass ``Objective``. The import path is how a user's objective reaches the fresh processes
that ``prove-resume``, ``chaos`` and ``launch`` start: their written config.yaml carries the same
string, and the child imports it again. Nothing else in ``src/`` lists the kinds.
"""

from __future__ import annotations

import importlib

from tpulab.config import import_named
from tpulab.errors import ConfigError
from tpulab.train.objective import Objective

BUILTINS = "tpulab.train.objectives"  # imported on the first lookup: its modules register
DEFAULT_KIND = "pretrain"  # what a run config without objective.kind trains
_KINDS: dict[str, type[Objective]] = {}


def register_objective(cls: type[Objective]) -> type[Objective]:
    """Register ``cls`` under ``cls.kind`` (usable as a class decorator); returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise ConfigError(f"{cls!r} is not a subclass of tpulab.Objective")
    kind = getattr(cls, "kind", "")
    if not kind or ":" in kind or "." in kind:
        raise ConfigError(f"{cls.__qualname__}.kind={kind!r} must be a plain name (no ':' or '.')")
    held = _KINDS.get(kind)
    if held is not None and held is not cls and _name(held) != _name(cls):
        raise ConfigError(
            f"objective kind {kind!r} is registered twice: {_name(held)}, {_name(cls)}"
        )
    _KINDS[kind] = cls
    return cls


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def registered() -> dict[str, type[Objective]]:
    """kind -> class, in registration order (the built-ins first)."""
    importlib.import_module(BUILTINS)
    return dict(_KINDS)


def objective_class(kind: str) -> type[Objective]:
    """The class ``kind`` names: a registered kind or ``package.module:Class``; else one line."""
    kinds = registered()
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"objective.kind={kind!r} must be one of {', '.join(kinds)}")
    if ":" not in kind:
        if kind not in kinds:
            raise ConfigError(
                f"objective.kind={kind!r} is not registered (registered: {', '.join(kinds)}; "
                "or name your own as package.module:Class)"
            )
        return kinds[kind]
    cls = import_named("objective.kind", kind)
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        module_name, _, attr = kind.partition(":")
        raise ConfigError(f"objective.kind={kind!r}: {attr} in {module_name} is not an Objective")
    return register_objective(cls)


def section_of(kind: str) -> tuple[str, type]:
    """The name and dataclass of ``kind``'s own config section (``objective.<name>.<field>``)."""
    cls = objective_class(kind)
    return cls.kind, cls.Config


def sections() -> dict[str, type]:
    """Every registered kind's section name -> its config dataclass."""
    return {k: c.Config for k, c in registered().items()}
