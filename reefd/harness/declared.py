"""The harness kinds an agent loads rather than reads: roles (subagents: a description, instructions and the tools
they may use) and extensions (MCP servers and hooks). Extensions are declarative only: one names a command the user
already has, or a URL, and Reef never ships a program. Owns their schemas (checked on every entry: a folder at load,
a mutation before it is published) and their files; knows nothing of how an agent installs them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
import yaml

from reefd.schema import first_error

HOOK_EVENTS = ("PreToolUse", "PostToolUse", "UserPromptSubmit", "Notification", "Stop", "SubagentStop",
               "SessionStart", "SessionEnd", "PreCompact")  # Claude Code's hook events
_PROGRAM = r"^(/[^\u0000]+|[A-Za-z0-9][A-Za-z0-9._+-]*)$"  # a program on the PATH, or an absolute path
_ARGV = {"type": "array", "minItems": 1, "maxItems": 64, "prefixItems": [{"type": "string", "pattern": _PROGRAM}],
         "items": {"type": "string", "maxLength": 4096}}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 1024}
_ENV = {"type": "object", "maxProperties": 64, "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "additionalProperties": {"type": "string", "maxLength": 4096}}

ROLE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["description", "body"], "additionalProperties": False,
    "properties": {"description": _TEXT, "body": {"type": "string"},
                   "tools": {"type": "array", "maxItems": 128, "uniqueItems": True,
                             "items": {"type": "string", "pattern": r"^[A-Za-z0-9_.:*()-]{1,128}$"}}},
}
EXTENSION_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type"],
    "properties": {"type": {"enum": ["mcp", "hook"]}},
    "allOf": [
        {"if": {"properties": {"type": {"const": "mcp"}}},
         "then": {"additionalProperties": False, "oneOf": [{"required": ["command"]}, {"required": ["url"]}],
                  "properties": {"type": True, "description": _TEXT, "command": _ARGV, "env": _ENV,
                                 "url": {"type": "string", "pattern": r"^https?://[^\s]+$", "maxLength": 2048}}}},
        {"if": {"properties": {"type": {"const": "hook"}}},
         "then": {"additionalProperties": False, "required": ["event", "command"],
                  "properties": {"type": True, "description": _TEXT, "event": {"enum": list(HOOK_EVENTS)},
                                 "matcher": {"type": "string", "maxLength": 256}, "command": _ARGV}}},
    ],
}
_ROLE = jsonschema.Draft202012Validator(ROLE_SCHEMA)
_EXTENSION = jsonschema.Draft202012Validator(EXTENSION_SCHEMA)


class Invalid(ValueError):
    """A role or an extension its schema refuses; str() is the key path and the reason, one line."""


def check_role(config: Mapping[str, Any]) -> None:
    _check(_ROLE, config)
    if len(str(config["description"]).splitlines()) != 1:
        raise Invalid("description must be one line")


def check_extension(config: Mapping[str, Any]) -> None:
    _check(_EXTENSION, config)


def _check(validator: jsonschema.Draft202012Validator, config: Mapping[str, Any]) -> None:
    found = first_error(validator, _plain(config))
    if found is not None:
        where, why = found
        raise Invalid(f"{where}: {why}" if where else why)


def _plain(value: Any) -> Any:
    """A frozen config as plain JSON values (what the schemas are written for)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def operator_only(kind: str, ident: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    """What changing one entry from `old` to `new` (None: absent) does that only an operator may do, e.g. "adds
    extension lint"; None when nothing. Extensions are programs and servers the agent runs, and a role's `tools`
    are what its subagent may use: a recipe's candidate that adds, changes or removes either is refused before its
    gate (reefd/grow/job_kinds/harness_job.py). A role's description and body are text, and stay a recipe's to
    edit, and a new role that lists no tools is allowed (it may use the agent's own, as any role without a list)."""
    if kind == "extension" and old != new:
        return f"{'adds' if old is None else 'removes' if new is None else 'changes'} extension {ident}"
    if kind != "role":
        return None
    before = None if old is None else old.get("tools")
    after = None if new is None else new.get("tools")
    if before == after:
        return None
    if before is None:
        return f"gives {'the new ' if old is None else ''}role {ident} a tools list"
    if new is None:
        return f"removes role {ident} and its tools list"
    return f"{'drops' if after is None else 'changes'} the tools list of role {ident}"


def role_file(ident: str, config: Mapping[str, Any]) -> bytes:
    """roles/<id>.md: front matter (name, description, tools when it names them), then the instructions."""
    meta: dict[str, Any] = {"name": ident, "description": config["description"]}
    if "tools" in config:
        meta["tools"] = list(config["tools"])
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1 << 20)
    return f"---\n{front}---\n\n{config['body']}\n".encode()


def extension_file(config: Mapping[str, Any]) -> bytes:
    """extensions/<id>.yaml, keys sorted."""
    return yaml.safe_dump(_plain(config), sort_keys=True, allow_unicode=True).encode("utf-8")
