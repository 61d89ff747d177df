"""Typed dataclass configs, validated at the edge.

Every config is a (nested) frozen dataclass. Values come from the dataclass defaults, then an
optional YAML file, then ``--set a.b=value`` overrides, in that order. Unknown keys and values of
the wrong type are errors that name the key; range checks live in each dataclass's
``__post_init__``. Fields marked ``resume_mutable`` (step count, logging) may change on resume;
every other field is part of the run's identity.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tpulab.errors import ConfigError

T = TypeVar("T")


def field(default: Any, doc: str, *, resume_mutable: bool = False) -> Any:
    """A documented dataclass field; ``resume_mutable`` fields may change between a run and its resume."""
    return dataclasses.field(default=default, metadata={"doc": doc, "resume_mutable": resume_mutable})


def nested(cls: type) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"doc": cls.__doc__ or ""})


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok. Used by ``__post_init__`` range checks."""
    if not ok:
        raise ConfigError(message)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, key) for v in value)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}' must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    return value


def _build(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def from_dict(cls: type[T], data: dict | None) -> T:
    """Build ``cls`` from a plain dict; unknown keys and wrong types raise ConfigError."""
    return _build(cls, dict(data or {}))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
         base: dict | None = None) -> T:
    """Defaults, then ``base`` (e.g. a checkpoint's config), then a YAML file, then ``--set`` overrides."""
    data: dict = _deep_copy(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        _merge(data, loaded)
    for item in overrides or []:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{k}' is not a section")
        node[keys[-1]] = value
    return from_dict(cls, data)


def _deep_copy(d: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def identity_diff(cls: type, old: dict, new: dict) -> list[str]:
    """Dotted keys whose values differ between two config dicts, ignoring resume-mutable fields."""
    diffs: list[str] = []

    def walk(c: type, a: dict, b: dict, prefix: str) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            key = prefix + f.name
            if f.metadata.get("resume_mutable"):
                continue
            va, vb = a.get(f.name), b.get(f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], va or {}, vb or {}, key + ".")
            elif _norm(va) != _norm(vb):
                diffs.append(f"{key}: {va!r} -> {vb!r}")

    walk(cls, old, new, "")
    return diffs


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
