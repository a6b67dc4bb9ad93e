"""Typed JSON -> frozen dataclasses, checked in one pass before anything is built from them.

Every field's annotation is its type check, and `field(metadata=...)` from `bounded`, `one_of`,
`template` or `relative_path` adds a range, a set of choices, a format: adding a field to a
manifest dataclass is one line. A JSON key no dataclass field names is refused with its dotted
name (a typo, or a bundle from a newer format); only `dict[...]` fields take free-form keys.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any

from .errors import SpecdeployError

MAX_ITEMS = 100_000  # the longest list any manifest field may hold (files, inputs, shape axes)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def bounded(low: int | float | None = None, high: int | float | None = None, **kwargs):
    """A numeric field within [low, high] (None: open on that side)."""
    return dataclasses.field(metadata={"range": (low, high)}, **kwargs)


def one_of(*choices, **kwargs):
    return dataclasses.field(metadata={"choices": choices}, **kwargs)


def template(**kwargs):
    """A printf template with exactly one %d (a layer number) and no other % directive."""
    return dataclasses.field(metadata={"check": _check_template}, **kwargs)


def relative_path(**kwargs):
    """A '/'-separated path relative to the bundle root: no absolute path, '..', '.' or empty part."""
    return dataclasses.field(metadata={"check": _check_relative}, **kwargs)


def sha256_hex(**kwargs):
    return dataclasses.field(metadata={"check": _check_sha256}, **kwargs)


def _check_template(value: str) -> str | None:
    if value.count("%d") != 1 or "%" in value.replace("%d", "", 1):
        return "must contain exactly one %d and no other %"
    return None


def _check_relative(value: str) -> str | None:
    parts = value.split("/")
    if not value or value.startswith("/") or "\\" in value or "\x00" in value:
        return "must be a relative '/'-separated path"
    if any(part in ("", ".", "..") for part in parts) or re.match(r"^[A-Za-z]:", value):
        return "must stay inside the bundle (no '..', '.', empty parts or drive letters)"
    return None


def _check_sha256(value: str) -> str | None:
    return None if _HEX64.match(value) else "must be 64 lowercase hex digits"


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build(cls, data: Any, where: str):
    """An instance of the dataclass cls from JSON data; SpecdeployError names the first bad field."""
    if not isinstance(data, dict):
        raise SpecdeployError(f"manifest: '{where or 'the top level'}' must be an object (got {_kind(data)})")
    fields = {item.name: item for item in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise SpecdeployError(f"manifest: unknown field '{_join(where, unknown[0])}' (not in format of this specdeploy)")
    kwargs = {}
    for name, item in fields.items():
        path = _join(where, name)
        if name not in data:
            if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                raise SpecdeployError(f"manifest: '{path}' is missing")
            continue
        value = convert(_hints(cls)[name], data[name], path)
        problem = _field_problem(item, value)
        if problem:
            raise SpecdeployError(f"manifest: '{path}' {problem} (got {_show(value)})")
        kwargs[name] = value
    return cls(**kwargs)


def convert(hint, value: Any, where: str):
    """value checked against the annotation hint (JSON lists become tuples, nested objects dataclasses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return convert(option, value, where)
            except SpecdeployError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is tuple:
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise SpecdeployError(f"manifest: '{where}' must be a list (got {_kind(value)})")
        return tuple(convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecdeployError(f"manifest: '{where}' must be an object (got {_kind(value)})")
        return {key: convert(args[1], item, _join(where, key)) for key, item in value.items()}
    return _scalar(hint, value, where)


def _scalar(hint, value: Any, where: str):
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise SpecdeployError(f"manifest: '{where}' must be {_NAMES.get(hint, hint.__name__)} (got {_kind(value)})")


def _field_problem(item: dataclasses.Field, value: Any) -> str | None:
    if value is None:
        return None
    meta = item.metadata
    if "range" in meta:
        low, high = meta["range"]
        if value != value or (low is not None and value < low) or (high is not None and value > high):  # NaN too
            return f"must be in {low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
    if "choices" in meta and value not in meta["choices"]:
        return f"must be one of {', '.join(map(str, meta['choices']))}"
    if "check" in meta:
        return meta["check"](value)
    return None


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(where: str, name: Any) -> str:
    return f"{where}.{name}" if where else str(name)
