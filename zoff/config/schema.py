"""Typed dataclasses from plain dicts: type coercion, ranges, unknown keys with the closest valid one.

Generic over any (frozen) dataclass schema whose fields carry `range_meta(...)` metadata; zoff.config defines
the schema and the contract around it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from zoff.errors import ConfigError


def range_meta(lo: float | None = None, hi: float | None = None, *, gt: bool = False) -> dict:
    """Field metadata: allowed range; `gt` makes the lower bound exclusive."""
    return {"lo": lo, "hi": hi, "gt": gt}


def build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {kind(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in fields:
            where = f"{path}.{k}" if path else str(k)
            raise ConfigError(f"unknown key {where}{suggest(str(k), list(fields), path)}")
    values = {}
    for name, f in fields.items():
        if name in raw:
            where = f"{path}.{name}" if path else name
            values[name] = _coerce(hints[name], raw[name], where, f.metadata)
    return cls(**values)


def _coerce(tp: Any, value: Any, where: str, meta: typing.Mapping = {}) -> Any:  # noqa: B006
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(strip_optional(tp), value, where, meta)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{where}: expected one of {choices}, got {value!r}{suggest(str(value), args)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        value = _as_number(value, where, "an integer")
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{where}: expected an integer, got {value!r}")
            value = int(value)
        return _check_range(value, where, meta)
    if tp is float:
        return _check_range(float(_as_number(value, where, "a number")), where, meta)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {kind(value)}")
        return str(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {kind(value)}")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {kind(value)}")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")  # a bug in the schema, not user input


def _as_number(value: Any, where: str, what: str) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {what}, got {value!r}")
    given = value
    if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string; accept it as a number
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{where}: expected {what}, got {value!r}") from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected {what}, got {kind(value)}")
    if (
        value != value
        or value in (float("inf"), float("-inf"))
        or (isinstance(value, int) and abs(value) > 2**1000)
    ):
        shown = given if not isinstance(given, int) else f"{str(given)[:12]}... ({len(str(given))} digits)"
        raise ConfigError(f"{where}: expected a finite number, got {shown!r}")
    return value


def _check_range(value: int | float, where: str, meta: typing.Mapping) -> int | float:
    lo, hi, gt = meta.get("lo"), meta.get("hi"), meta.get("gt", False)
    if lo is not None and (value <= lo if gt else value < lo):
        raise ConfigError(f"{where}: must be {'>' if gt else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}: must be <= {hi}, got {value}")
    return value


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def suggest(word: str, options: typing.Iterable[Any], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)"


def kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )
