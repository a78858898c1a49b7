"""Scenario keys that moved: the table of old dotted paths and their new ones, applied to a composed scenario (plain
containers) before validation, so that a scenario written for the previous release still loads, with one warning per
old key. Knows nothing of the dataclasses behind the keys; each plug point says how its own moved keys go in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from reefd.grow import backends

Place = Callable[[Any, str, Any], Any]


@dataclass(frozen=True)
class Moved:
    """`old` is read as `new` for one release, then goes. A last part `*` moves each key of the mapping at `old`
    to the same key under `new`. `place(the value at new's parent or None, new's last part, the old value)` gives
    that parent's new value, or None where the old key was never read (it is dropped); without it, the key is set
    in the parent mapping."""

    old: str
    new: str
    place: Place | None = None


MOVED = (  # e37b24b: recipe.backend became a kind or {kind: KIND, ...its keys}
    Moved("recipe.ray_address", "recipe.backend.address", backends.into_cluster),
    Moved("recipe.ray_resources", "recipe.backend.resources", backends.into_cluster),
    Moved("recipe.slime.*", "recipe.backend.*", backends.into_slime),
)


class MovedKeyError(ValueError):
    """An old key and its new one are both set. str() names both."""


_UNSET = object()


def _get(raw: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return _UNSET
        raw = raw[part]
    return raw


def _parent(raw: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The mapping that holds `path` (made where missing) and its last part."""
    *parents, leaf = path.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    return raw, leaf


def _flow(value: Any) -> str:
    if not isinstance(value, dict | list):
        return str(value)
    return str(yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000)).strip()


def apply(raw: dict[str, Any], table: tuple[Moved, ...] = MOVED) -> list[str]:
    """Move every old key set in `raw` to its new place, in place; one warning for each (naming both keys).
    MovedKeyError: an old key and its new one are both set."""
    notes = []
    for move in table:
        if not move.old.endswith(".*"):
            if _get(raw, move.old) is not _UNSET:
                notes.append(_move(raw, move.old, move.new, move.place))
            continue
        prefix, new_prefix = move.old.removesuffix(".*"), move.new.removesuffix(".*")
        keys = _get(raw, prefix)
        if isinstance(keys, dict) or keys is None:
            if not keys:
                notes.append(f"{prefix} is an old key (its keys go under {new_prefix}), empty here: delete it")
            for key in list(keys or {}):
                notes.append(_move(raw, f"{prefix}.{key}", f"{new_prefix}.{key}", move.place))
            holder, leaf = _parent(raw, prefix)
            del holder[leaf]
    return notes


def _move(raw: dict[str, Any], old: str, new: str, place: Place | None) -> str:
    if _get(raw, new) is not _UNSET:
        raise MovedKeyError(f"{old} and {new} are both set: {old} is the old name of {new}; keep {new} alone")
    holder, leaf = _parent(raw, old)
    value = holder.pop(leaf)
    parent_path, _, key = new.rpartition(".")
    parent = _get(raw, parent_path)
    parent = None if parent is _UNSET else parent
    placed = {**(parent or {}), key: value} if place is None else place(parent, key, value)
    if placed is None:
        shown = "unset: the default" if parent is None else _flow(parent)
        return (f"{old} is the old name of {new}, which this scenario's {parent_path} ({shown}) does not read, "
                "nor did it read the old one: delete it")
    holder, leaf = _parent(raw, parent_path)
    holder[leaf] = placed
    return f"{old} is the old name of {new} (read for one more release): write `{parent_path}: {_flow(placed)}`"
