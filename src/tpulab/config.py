"""The config machinery, validated at the edge: documented fields, checks, the YAML loader.

No config lives here: each package declares its own in its ``config.py`` (the run's tree is
``tpulab.train.config.RunConfig``; ``tpulab.load_config`` is ``load(RunConfig, ...)``). Every
config is a (nested) frozen dataclass. Values come from the dataclass defaults, then an optional
YAML file, then ``--set a.b=value`` overrides, in that order. Unknown keys and values of the wrong
type are errors that name the key, and so is a non-finite float (``inf``, ``nan``, ``1e999``)
unless its field allows one; range checks (including upper bounds on integers, which would
otherwise overflow deep inside JAX or XLA) live in each dataclass's ``__post_init__``. Fields
marked ``resume_mutable`` (step count, logging) may change on resume; every other field is part
of the run's identity.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tpulab.errors import ConfigError

T = TypeVar("T")


# Linux limits (PATH_MAX, NAME_MAX): longer paths fail in the kernel with ENAMETOOLONG.
PATH_MAX_BYTES = 4095
NAME_MAX_BYTES = 255
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def field(
    default: Any, doc: str, *, resume_mutable: bool = False, allow_nonfinite: bool = False
) -> Any:
    """A documented dataclass field; a ``resume_mutable`` one may change on resume.

    Float fields must be finite unless ``allow_nonfinite``: an ``inf`` learning rate or epsilon
    trains into NaN (or into nothing) instead of failing at the edge.
    """
    return dataclasses.field(
        default=default,
        metadata={"doc": doc, "resume_mutable": resume_mutable, "allow_nonfinite": allow_nonfinite},
    )


def nested(cls: type) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"doc": cls.__doc__ or ""})


@dataclasses.dataclass(frozen=True)
class Sections:
    """How a ``section`` field finds its type: ``resolve(value)`` gives the section's name and
    dataclass for the sibling ``key``'s value (one line ConfigError if there is none); ``known()``
    every name -> dataclass, so a section of another value is refused naming its owner."""

    key: str
    resolve: Callable[[Any], tuple[str, type]]
    known: Callable[[], dict[str, type]]


def section(sections: Sections, doc: str) -> Any:
    """A field whose dataclass depends on a sibling field (``objective.kind``), spelled in YAML and
    ``--set`` by the name the sibling resolves to (``objective.dpo.beta``), not by the field's own
    name; ``None`` until built (its owner's ``__post_init__`` fills in the defaults)."""
    return dataclasses.field(default=None, metadata={"doc": doc, "sections": sections})


def chosen(sections: Sections, default: type, doc: str) -> Any:
    """A section whose dataclass its own ``sections.key`` field names (``model.family``); absent,
    ``default``. The key is a field of every dataclass it can name."""
    return dataclasses.field(default_factory=default, metadata={"doc": doc, "chosen": sections})


def _chosen_class(spec: Sections, value: Any, default: type) -> type:
    key = value.get(spec.key) if isinstance(value, dict) else None
    return default if key is None else spec.resolve(key)[1]


def _sections(cls: type) -> dict[str, Sections]:
    return {
        f.name: f.metadata["sections"] for f in dataclasses.fields(cls) if "sections" in f.metadata
    }


def import_named(key: str, value: str) -> Any:
    """The object an import path ``package.module:Name`` names (a user's objective or model family,
    which child processes import again from their written config); a failed import is one line."""
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}={value!r}: cannot import {module_name} ({e})") from None
    return getattr(module, attr, None)


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok. Used by ``__post_init__`` range checks."""
    if not ok:
        raise ConfigError(message)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters.

    An error line names the value; it does not print 400 digits.
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} characters)"


def check_int(value: int, key: str, lo: int, hi: int, why: str = "") -> None:
    """Raise ConfigError unless ``lo <= value <= hi`` (``why`` says where the bound comes from)."""
    check(
        lo <= value <= hi,
        f"{key}={short(value)} must be in [{lo}, {hi}]" + (f" ({why})" if why else ""),
    )


def check_path(value: str, key: str) -> None:
    """Refuse a path string the OS cannot use: empty, a NUL byte, or over the Linux length limits.

    A pure string check (no file system access), so it runs at config time, before a run dir is
    made. An empty path would silently mean the current directory.
    """
    check(value != "", f"{key} must not be empty")
    check("\0" not in value, f"{key} contains a NUL byte")
    raw = os.fsencode(value)
    check(
        len(raw) <= PATH_MAX_BYTES,
        f"{key} is {len(raw)} bytes long; paths are limited to {PATH_MAX_BYTES}",
    )
    longest = max(raw.split(b"/"), key=len)
    check(
        len(longest) <= NAME_MAX_BYTES,
        f"{key} has a {len(longest)}-byte name "
        f"'{os.fsdecode(longest[:40])}...'; names are limited to {NAME_MAX_BYTES} bytes",
    )


def _coerce(value: Any, tp: Any, key: str, allow_nonfinite: bool = False) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key, allow_nonfinite)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {short(value)}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {short(value)}")
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, key, allow_nonfinite) for v in value)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(
                f"config key '{key}' must be one of {list(typing.get_args(tp))}, got {short(value)}"
            )
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {short(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {short(value)}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"config key '{key}' must be a number, got {short(value)}")
        try:
            number = float(number)
        except OverflowError:  # an integer beyond the float range
            number = math.inf
        if not (allow_nonfinite or math.isfinite(number)):
            raise ConfigError(f"config key '{key}' must be a finite number, got {short(value)}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}' must be a string, got {short(value)}")
    return value


def _build(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    sections = _sections(cls)
    data, built = _build_sections(cls, sections, data, prefix)
    known = set(fields) - set(sections)
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}' (known: {', '.join(sorted(known))})"
        )
    kwargs = {
        k: _coerce(
            v,
            _hint(fields[k], hints[k], v),
            prefix + k,
            fields[k].metadata.get("allow_nonfinite", False),
        )
        for k, v in data.items()
    }
    return cls(**kwargs, **built)


def _hint(f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """The type to build ``value`` as: a ``chosen`` field's is the class its key names."""
    spec = f.metadata.get("chosen")
    return hint if spec is None else _chosen_class(spec, value, f.default_factory)


def _build_sections(
    cls: type, sections: dict[str, Sections], data: dict, prefix: str
) -> tuple[dict, dict]:
    """Take each section out of ``data`` under the name its key's value resolves to.

    A section of another value is an error naming its owner unless it holds only that owner's
    defaults (a run config written before sections were per kind holds every kind's defaults).
    """
    data, built = dict(data), {}
    if not set(map(str, data)) - {f.name for f in dataclasses.fields(cls)}:
        return data, built  # no section given: nothing to resolve (its owner fills in defaults)
    for name, spec in sections.items():
        default = next(f.default for f in dataclasses.fields(cls) if f.name == spec.key)
        value = data.get(spec.key, default)
        own, own_cls = spec.resolve(value)
        if own in data:
            built[name] = _coerce(data.pop(own), own_cls, prefix + own)
        for other, other_cls in spec.known().items():
            if other == own or other not in data:
                continue
            given = _coerce(data.pop(other), other_cls, prefix + other)
            check(
                given == other_cls(),
                f"{prefix}{other} applies to {prefix}{spec.key}={other}, not {value}",
            )
    return data, built


def from_dict(cls: type[T], data: dict | None) -> T:
    """Build ``cls`` from a plain dict; unknown keys and wrong types raise ConfigError."""
    return _build(cls, dict(data or {}))


def to_dict(cfg: Any) -> dict:
    """The config as plain data; a ``section`` field under the name its key resolves to."""
    out = dataclasses.asdict(cfg)
    _rename_sections(cfg, out)
    return out


def _rename_sections(cfg: Any, out: dict) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        spec = f.metadata.get("sections")
        if spec is not None:
            name, _ = spec.resolve(getattr(cfg, spec.key))
            out[name] = out.pop(f.name)
            f_out = out[name]
        else:
            f_out = out[f.name]
        if dataclasses.is_dataclass(value) and isinstance(f_out, dict):
            _rename_sections(value, f_out)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (
        yaml.YAMLError,
        ValueError,
        RecursionError,
    ):  # ValueError: an impossible date such as 2024-13-01
        value = raw
    return key.strip().split("."), value


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | None = None,
) -> T:
    """Defaults, then ``base`` (a checkpoint's config), a YAML file, ``--set`` overrides."""
    data: dict = _deep_copy(base or {})
    if path is not None:
        loaded = _read_yaml(Path(path))
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
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


def _read_yaml(p: Path) -> Any:
    """The file's YAML, or a ConfigError naming it: missing, unreadable, not UTF-8, not YAML."""
    check_path(str(p), "config file path")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    except (ValueError, RecursionError) as e:  # an impossible date (2024-13-01), absurd nesting
        raise ConfigError(f"config file {p} is not valid YAML: {type(e).__name__}: {e}") from None


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
            spec = f.metadata.get("sections")
            if spec is not None:  # the section of the new value: a changed value is a diff itself
                name, sec_cls = spec.resolve(b.get(spec.key))
                walk(sec_cls, a.get(name) or {}, b.get(name) or {}, prefix + name + ".")
                continue
            # a key written before its field existed held the field's default
            unset = None if f.default is dataclasses.MISSING else f.default
            va, vb = a.get(f.name, unset), b.get(f.name, unset)
            hint = hints[f.name]
            if "chosen" in f.metadata:
                hint = _chosen_class(f.metadata["chosen"], vb, f.default_factory)
            if dataclasses.is_dataclass(hint):
                walk(hint, va or {}, vb or {}, key + ".")
            elif _norm(va) != _norm(vb):
                diffs.append(f"{key}: {va!r} -> {vb!r}")

    walk(cls, old, new, "")
    return diffs


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
