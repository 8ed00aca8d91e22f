"""Typed JSON for the bundle's records: frozen dataclasses written by :func:`to_json` and read back,
strictly, by :func:`from_json`.

The dataclass fields are the only place a manifest key is spelled. Reading checks every value
against its field's type (nested records, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``,
``Literal``), refuses missing and unknown keys (the writer writes every field, defaults included),
and names the key at fault by its full path (``engine.profiles[0].max``). Paths are
:class:`mbert.bundle.paths.RelPath`: relative names that stay inside their folder (no absolute
path, no ``..``, no empty or ``.`` component, no backslash or NUL).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

from mbert.bundle.errors import BundleError, MbertError
from mbert.bundle.paths import RelPath, check_relpath


def to_json(value: Any) -> Any:
    """A JSON-ready value: dataclasses become objects keyed by field name, tuples lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, float):
        assert math.isfinite(value), "records hold finite floats only (None stands for 'not finite')"
    return value


def from_json(tp: Any, value: Any, key: str) -> Any:
    """``value`` (parsed JSON) as an instance of ``tp``; BundleError naming ``key`` otherwise."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _record(tp, value, key)
    if origin in (Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None:
            if type(None) in arms:
                return None
            raise BundleError(f"{key}: must not be null")
        errors = []
        for arm in (a for a in arms if a is not type(None)):
            try:
                return from_json(arm, value, key)
            except BundleError as exc:
                errors.append(str(exc))
        raise BundleError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is none of the allowed types")
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            allowed = ", ".join(repr(a) for a in typing.get_args(tp))
            raise BundleError(f"{key}: {value!r} is not one of {allowed}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise BundleError(f"{key}: expected a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise BundleError(f"{key}: expected {len(args)} entries, got {len(value)}")
        return tuple(from_json(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise BundleError(f"{key}: expected an object, got {_kind(value)}")
        return {from_json(key_type, k, f"{key} key {k!r}"): from_json(value_type, v, f"{key}[{k!r}]")
                for k, v in value.items()}
    if tp is RelPath:
        return check_relpath(value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise BundleError(f"{key}: expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BundleError(f"{key}: expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BundleError(f"{key}: expected a finite number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise BundleError(f"{key}: expected a string, got {_kind(value)}")
        return value
    raise AssertionError(f"no JSON reading for type {tp!r} ({key})")


def _record(cls: type, value: Any, key: str) -> Any:
    if not isinstance(value, dict):
        raise BundleError(f"{key}: expected an object, got {_kind(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise BundleError(f"{_join(key, unknown[0])}: unknown key (a {cls.__name__} has "
                          f"{', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name in fields:  # every key is written, so every key must be there (defaults are for code)
        if name not in value:
            raise BundleError(f"{_join(key, name)}: required key is missing")
        kwargs[name] = from_json(hints[name], value[name], _join(key, name))
    try:
        return cls(**kwargs)
    except (MbertError, ValueError, TypeError) as exc:  # a record's own range checks
        raise BundleError(f"{key or cls.__name__}: {exc}") from exc


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _kind(value: Any) -> str:
    name = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value))
    return f"{name or type(value).__name__} ({value!r:.60})"
