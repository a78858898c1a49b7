"""One harness entry (rules, skill, prompt, role, extension or config): its id and config checked, made canonical
and frozen, and its file rendered byte for byte. Knows nothing of a harness's other entries, its limits or how a
folder is read."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from reefd.harness import declared

KINDS = ("rules", "skill", "prompt", "role", "extension", "config")
ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
CONFIG_ID = "config"
MAX_BODY_BYTES = 64 * 1024  # one body, UTF-8
MAX_DESCRIPTION_CHARS = 1024  # one skill description, one line
FOLDERS = {"rules": "rules", "prompt": "prompts", "role": "roles"}  # kinds kept as <folder>/<id>.md

_ID_RE = re.compile(ID_PATTERN[1:-1])  # used with fullmatch: "$" alone would let "x\n" through
_WORD_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SKILL_FILE = "SKILL.md"
_MAX_DEPTH = 32  # nesting of config values
_MAX_VALUES = 100_000  # values in one config (YAML aliases can multiply them)
_WIDTH = 1 << 20  # front matter lines never wrap


class HarnessError(ValueError):
    """Invalid harness data. `where` names the entry, mutation or file; `reason` says what is wrong; one line."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason

    def __reduce__(self) -> tuple[type[HarnessError], tuple[str, str]]:
        return type(self), (self.where, self.reason)


class _Bad(Exception):
    """A reason, raised before the caller knows which entry, mutation or file to name."""


@dataclass(frozen=True)
class Entry:
    """One entry; `config` is checked, made canonical and frozen (read-only mappings, tuples for lists) here.

    rules, prompt: {"body"}; skill: {"description", "body"}; role: {"description", "body", "tools"?};
    extension: an MCP server or a hook (declared.EXTENSION_SCHEMA); config: any JSON-like mapping, id "config".
    Bodies get LF line endings and lose leading and trailing blank lines; descriptions are stripped.
    Raises HarnessError naming "<kind> <id>".
    """

    id: str
    kind: str
    config: Mapping[str, Any] = field(hash=False)
    _file: bytes = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        try:
            config = _check_entry(self.kind, self.id, self.config)
            rendered = _render(self.kind, self.id, config)
        except _Bad as e:
            raise HarnessError(f"{_word(self.kind)} {_word(self.id)}", str(e)) from None
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_file", rendered)

    @property
    def path(self) -> str:
        """The rendered file, relative to the harness folder."""
        if self.kind == "config":
            return "config.yaml"
        if self.kind == "skill":
            return f"skills/{self.id}/{_SKILL_FILE}"
        if self.kind == "extension":
            return f"extensions/{self.id}.yaml"
        return f"{FOLDERS[self.kind]}/{self.id}.md"

    @property
    def file(self) -> bytes:
        """The rendered file's bytes."""
        return self._file

    def to_json(self) -> dict[str, Any]:
        """{"id", "kind", "config"} with plain dicts and lists."""
        return {"id": self.id, "kind": self.kind, "config": _thaw(self.config)}



def _exact_keys(mapping: Mapping[Any, Any], keys: tuple[str, ...], what: str) -> None:
    """_Bad unless `mapping` has exactly `keys`."""
    for key in mapping:
        if key not in keys:
            raise _Bad(f"unknown {what} key {_word(key)} (expected {', '.join(keys)})")
    for key in keys:
        if key not in mapping:
            raise _Bad(f"{what} needs {key!r}")


def _word(value: object) -> str:
    """`value` for a one-line message: bare when it is a plain token, else a short repr."""
    if isinstance(value, str) and _WORD_RE.fullmatch(value):
        return value
    text = repr(value)
    return text if len(text) <= 70 else text[:67] + "..."


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise _Bad(f"{what} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Bad(f"{what} is not valid UTF-8") from None
    return value


def _check_id(value: object) -> str:
    ident = _text(value, "id")
    if not _ID_RE.fullmatch(ident):
        raise _Bad(f"invalid id {_word(ident)} (must match {ID_PATTERN})")
    return ident


def _check_entry(kind: object, ident: object, config: object) -> Mapping[str, Any]:
    if kind not in KINDS:
        raise _Bad(f"unknown kind {_word(kind)} (expected {'|'.join(KINDS)})")
    _check_id(ident)
    if kind == "config" and ident != CONFIG_ID:
        raise _Bad(f"the config entry's id must be {CONFIG_ID!r}")
    if not isinstance(config, Mapping):
        raise _Bad(f"config must be a mapping, got {type(config).__name__}")
    if kind in ("config", "extension", "role"):
        frozen: Mapping[str, Any] = _freeze(config, "config", [_MAX_VALUES], 0)
        if kind == "config":
            return frozen
        try:
            (declared.check_extension if kind == "extension" else declared.check_role)(frozen)
        except declared.Invalid as e:
            raise _Bad(str(e)) from None
        if kind == "extension":
            return frozen
        return MappingProxyType({**frozen, "description": _description(frozen["description"]),
                                 "body": _body(frozen["body"])})
    _exact_keys(config, ("description", "body") if kind == "skill" else ("body",), "config")
    out = {"body": _body(config["body"])}
    if kind == "skill":
        out = {"description": _description(config["description"]), **out}
    return MappingProxyType(out)


def _body(value: object) -> str:
    body = _text(value, "body").replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    if not body.strip():
        raise _Bad("body is empty")
    size = len(body.encode("utf-8"))
    if size > MAX_BODY_BYTES:
        raise _Bad(f"body is {size} bytes (limit {MAX_BODY_BYTES})")
    return body


def _description(value: object) -> str:
    text = _text(value, "description").strip()
    if not text:
        raise _Bad("description is empty")
    if len(text.splitlines()) != 1:
        raise _Bad("description must be one line")
    if len(text) > MAX_DESCRIPTION_CHARS:
        raise _Bad(f"description is {len(text)} characters (limit {MAX_DESCRIPTION_CHARS})")
    return text


def _freeze(value: object, at: str, budget: list[int], depth: int) -> Any:
    """Check a JSON-like config value (str keys, finite numbers, no NUL) and freeze it."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _Bad(f"config has more than {_MAX_VALUES} values")
    if depth > _MAX_DEPTH:
        raise _Bad(f"{at}: nested deeper than {_MAX_DEPTH} levels")
    if value is None or type(value) in (bool, int):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise _Bad(f"{at}: {value} is not a finite number")
        return value
    if type(value) is str:
        return _text(value, at)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _Bad(f"{at}: key {_word(key)} is not a string")
            out[_text(key, f"{at}: key")] = _freeze(item, f"{at}.{_word(key)}", budget, depth + 1)
        return MappingProxyType(out)
    if isinstance(value, list | tuple):
        return tuple(_freeze(item, f"{at}[{i}]", budget, depth + 1) for i, item in enumerate(value))
    raise _Bad(f"{at}: unsupported value of type {type(value).__name__}")


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _render(kind: str, ident: str, config: Mapping[str, Any]) -> bytes:
    if kind == "config":
        return yaml.safe_dump(_thaw(config), sort_keys=True, allow_unicode=True).encode("utf-8")
    if kind == "extension":
        return declared.extension_file(config)
    if kind == "role":
        return declared.role_file(ident, config)
    body = config["body"] + "\n"
    if kind != "skill":
        return body.encode("utf-8")
    meta = {"name": ident, "description": config["description"]}
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=_WIDTH)
    return f"---\n{front}---\n\n{body}".encode()
