"""Config dataclasses as JSON Schema, and validation into them with one-line errors that name the key's path.

Every concept owns a small config dataclass (a model, a gate kind, a recipe's params, an objective's settings);
this module turns one into a schema (types, enums, bounds, no unknown keys) and checks data against it.
Knows nothing about scenarios, Hydra or any plug point.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import jsonschema


class SchemaError(ValueError):
    """Data that does not fit a config dataclass; str() is `path.to.key: message`, one line."""


CEILING = 1e9  # the bound of a number field that states none: no setting means more (a count, a size, seconds)
_NUMBERS = frozenset({int, float})


def _is_number_field(tp: Any) -> bool:
    """int or float, optional or not (bool is its own type here)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(a in _NUMBERS for a in typing.get_args(tp))
    return tp in _NUMBERS


def _type_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(a) for a in typing.get_args(tp)]}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": _type_schema(item)}
    if origin is dict:
        return {"type": "object"}
    if dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)  # type: ignore[arg-type]
    mapping = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
    if tp in mapping:
        return {"type": mapping[tp]}
    if tp is Any:
        return {}
    raise TypeError(f"no JSON Schema for {tp!r}")


def dataclass_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of a config dataclass: types, enums, bounds (from field metadata), no unknown keys."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub = _type_schema(hints[f.name])
        meta = dict(f.metadata)
        if "enum" in meta:
            sub = {"enum": meta.pop("enum")}
        sub.update(meta)
        if _is_number_field(hints[f.name]) and "maximum" not in sub and "exclusiveMaximum" not in sub:
            sub["maximum"] = CEILING
        if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
            sub["default"] = f.default
        props[f.name] = sub
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not the dataclass's generated one
        schema["description"] = cls.__doc__.strip()
    return schema


def first_error(validator: jsonschema.protocols.Validator, data: Any) -> tuple[str, str] | None:
    """(dotted path, message) of the first problem (shallowest path first), or None when the data is valid.

    For a value that fits none of `anyOf`'s branches, the message of an `enum` branch is given when there is
    one ("'x' is not one of [...]"): it lists the names a user meant to choose from; else, for an object (an
    optional block that is set), the first problem inside it."""
    unbounded = _non_finite(data, [])
    if unbounded is not None:  # JSON Schema's bounds let NaN through (every comparison with it is false)
        path, value = unbounded
        return ".".join(path), f"{value!r} is not a finite number"
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return None
    err = errors[0]
    if err.validator == "anyOf":
        # an optional block that is set: its own problem, with its key's path
        inner = [e for e in err.context or () if e.validator != "type" and len(e.relative_path) > 0]
        err = next((e for e in err.context or () if e.validator == "enum"), inner[0] if inner else err)
    message = err.message.replace("is a required property", "is required")
    return ".".join(str(p) for p in err.absolute_path), message


def _non_finite(data: Any, path: list[str]) -> tuple[list[str], float] | None:
    """The first NaN or infinity in `data` (YAML's .nan and .inf), anywhere, with its path."""
    if isinstance(data, float) and not math.isfinite(data):
        return path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _non_finite(value, [*path, str(key)])
        if found is not None:
            return found
    return None


def parse(cls: type, data: Any, where: str) -> Any:
    """An instance of the config dataclass `cls` from `data` (a mapping; None means all defaults), checked
    against its schema; SchemaError names `where.KEY` on the first problem."""
    data = {} if data is None else data
    found = first_error(jsonschema.Draft202012Validator(dataclass_schema(cls)), data)
    if found is not None:
        path, message = found
        raise SchemaError(f"{'.'.join(p for p in (where, path) if p)}: {message}")
    return _build(cls, data)


def _build(cls: type, data: dict[str, Any]) -> Any:
    """`cls(**data)`, with each field typed as a dataclass built from its (already validated) mapping."""
    hints = typing.get_type_hints(cls)
    values = dict(data)
    for f in dataclasses.fields(cls):
        if f.name in values and dataclasses.is_dataclass(hints[f.name]) and isinstance(values[f.name], dict):
            values[f.name] = _build(hints[f.name], values[f.name])
    return cls(**values)
