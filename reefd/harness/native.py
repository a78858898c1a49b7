"""What each coding agent receives for the harness kinds it loads itself, in the agent's own format: prompts become
its commands, roles its subagents, extensions (MCP servers and hooks) entries of its config. Knows nothing of sh,
of the folders these land in (installer.py and sh/*.sh own those) or of how a harness is made.

Formats, as each agent documents them:
- Claude Code: commands/<id>.md and agents/<id>.md (front matter name, description, tools as "A, B"); an MCP server
  as the JSON `claude mcp add-json` takes; a hook as one matcher group of its settings' "hooks".
- Codex CLI: prompts/<id>.md (/prompts:<id>) and agents/<id>.toml (name, description, developer_instructions); MCP
  servers and hooks as config.toml tables ([mcp_servers.<id>], [[hooks.<Event>]]).
- opencode: command/<id>.md and agent/<id>.md (mode: subagent, tools as a map); MCP servers as "mcp" entries of its
  config. Its hooks are JavaScript plugins, so a command hook has no place there.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from reefd.harness import Harness
from reefd.harness.entry import Entry

# The folders an agent reads placed files from, by the name installer.py gives them in paths().
PLACES = ("commands", "agents")
# Codex CLI's hook events (developers.openai.com/codex/hooks); Reef's others have no Codex counterpart.
CODEX_HOOK_EVENTS = ("PreToolUse", "PostToolUse", "UserPromptSubmit", "Stop", "SubagentStop", "SessionStart",
                     "PreCompact")
# opencode's built-in tools, which Claude Code's tool names lower-cased mostly are (LS is its list).
_OPENCODE_TOOLS = {"ls": "list", "multiedit": "edit", "notebookedit": "edit"}
_WIDTH = 1 << 20  # front matter never wraps
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Placed:
    """A file the agent reads from one of its folders: `place` (one of PLACES) / `name`."""

    place: str
    name: str
    text: str


@dataclass(frozen=True)
class Extension:
    """One extension as this agent takes it. `form` names the fragment (its file name in the release folder):
    mcp.json, hook.<Event>.json (Claude Code), config.toml (Codex), entry.json (opencode); "" when the agent has no
    place for it, and `why_not` says why. `shown` is the line the installer shows before it asks."""

    id: str
    shown: str
    form: str
    text: str
    why_not: str = ""


def placed(adapter: str, harness: Harness) -> list[Placed]:
    """The prompts as commands and the roles as subagents, in `adapter`'s formats; none for generic."""
    if adapter == "generic":
        return []
    ext = "toml" if adapter == "codex" else "md"
    out = [Placed("commands", f"{e.id}.md", _command(e)) for e in harness.of_kind("prompt")]
    out += [Placed("agents", f"{e.id}.{ext}", _ROLES[adapter](e)) for e in harness.of_kind("role")]
    return out


def extensions(adapter: str, harness: Harness) -> list[Extension]:
    """Each extension of `harness` as `adapter` takes it; none for generic, which enables nothing."""
    if adapter == "generic":
        return []
    out = []
    for e in harness.of_kind("extension"):
        config: Mapping[str, Any] = e.config
        shown = _shown(e.id, config)
        if config["type"] == "mcp":
            form, text = _MCP[adapter](e.id, config)
            out.append(Extension(e.id, shown, form, text))
        elif adapter == "opencode":
            out.append(Extension(e.id, shown, "", "", "opencode runs hooks as JavaScript plugins, not commands"))
        elif adapter == "codex" and config["event"] not in CODEX_HOOK_EVENTS:
            out.append(Extension(e.id, shown, "", "", f"Codex has no {config['event']} hook event"))
        elif adapter == "codex":
            out.append(Extension(e.id, shown, "config.toml", _codex_hook(config)))
        else:
            group = {**({"matcher": config["matcher"]} if "matcher" in config else {}),
                     "hooks": [{"type": "command", "command": shlex.join(config["command"])}]}
            out.append(Extension(e.id, shown, f"hook.{config['event']}.json", json.dumps(group)))
    return out


def _shown(ident: str, config: Mapping[str, Any]) -> str:
    """One printable line: what the extension is and what it runs or reaches."""
    if config["type"] == "mcp" and "url" in config:
        what = f"MCP server at {config['url']}"
    elif config["type"] == "mcp":
        env = f" with {', '.join(config['env'])} set" if config.get("env") else ""
        what = f"MCP server, runs: {shlex.join(config['command'])}{env}"
    else:
        matcher = f" ({config['matcher']})" if config.get("matcher") else ""
        what = f"hook on {config['event']}{matcher}, runs: {shlex.join(config['command'])}"
    about = f" - {config['description']}" if config.get("description") else ""
    return _CONTROL.sub(" ", f"{ident}: {what}{about}")


def _command(e: Entry) -> str:
    """A prompt as a command file: front matter with a description (its first line), then the body."""
    first = next(line for line in e.config["body"].split("\n") if line.strip()).strip()
    first = first if len(first) <= 100 else first[:97] + "..."
    return _front({"description": first}, e.config["body"])


def _front(meta: Mapping[str, Any], body: str) -> str:
    return f"---\n{yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True, width=_WIDTH)}---\n\n{body}\n"


def _claude_role(e: Entry) -> str:
    meta: dict[str, Any] = {"name": e.id, "description": e.config["description"]}
    if "tools" in e.config:
        meta["tools"] = ", ".join(e.config["tools"])
    return _front(meta, e.config["body"])


def _opencode_role(e: Entry) -> str:
    meta: dict[str, Any] = {"description": e.config["description"], "mode": "subagent"}
    if "tools" in e.config:  # every tool off, then the ones the role names on
        names = (_opencode_tool(t) for t in e.config["tools"])
        meta["tools"] = {"*": False, **{n: True for n in names if n}}
    return _front(meta, e.config["body"])


def _opencode_tool(name: str) -> str:
    bare = name.split("(", 1)[0].strip().lower()  # Bash(git *) -> bash
    return _OPENCODE_TOOLS.get(bare, bare)


def _codex_role(e: Entry) -> str:
    """A Codex custom agent. Codex has no per-agent tool list, so the tools become a line of its instructions."""
    body = e.config["body"]
    if "tools" in e.config:
        body += f"\n\nUse only these tools: {', '.join(e.config['tools'])}."
    return "".join(f"{k} = {toml_str(v)}\n" for k, v in
                   (("name", e.id), ("description", e.config["description"]), ("developer_instructions", body)))


def toml_str(value: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, but for DEL, which TOML wants escaped too."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(toml_str(v) for v in values) + "]"


def _claude_mcp(ident: str, config: Mapping[str, Any]) -> tuple[str, str]:
    if "url" in config:
        server: dict[str, Any] = {"type": "sse" if config["url"].rstrip("/").endswith("/sse") else "http",
                                  "url": config["url"]}
    else:
        server = {"type": "stdio", "command": config["command"][0], "args": list(config["command"][1:]),
                  "env": dict(config.get("env") or {})}
    return "mcp.json", json.dumps(server)


def _codex_mcp(ident: str, config: Mapping[str, Any]) -> tuple[str, str]:
    lines = [f"[mcp_servers.{ident}]"]
    if "url" in config:
        lines.append(f"url = {toml_str(config['url'])}")
    else:
        lines += [f"command = {toml_str(config['command'][0])}", f"args = {_toml_list(config['command'][1:])}"]
        if config.get("env"):
            pairs = ", ".join(f"{k} = {toml_str(v)}" for k, v in config["env"].items())
            lines.append(f"env = {{ {pairs} }}")
    return "config.toml", "\n".join(lines) + "\n"


def _codex_hook(config: Mapping[str, Any]) -> str:
    event = config["event"]
    lines = [f"[[hooks.{event}]]"]
    if config.get("matcher"):
        lines.append(f"matcher = {toml_str(config['matcher'])}")
    lines += [f"[[hooks.{event}.hooks]]", 'type = "command"', f"command = {toml_str(shlex.join(config['command']))}"]
    return "\n".join(lines) + "\n"


def _opencode_mcp(ident: str, config: Mapping[str, Any]) -> tuple[str, str]:
    if "url" in config:
        server: dict[str, Any] = {"type": "remote", "url": config["url"], "enabled": True}
    else:
        server = {"type": "local", "command": list(config["command"]), "enabled": True}
        if config.get("env"):
            server["environment"] = dict(config["env"])
    return "entry.json", f"{json.dumps(ident)}: {json.dumps(server)}"


_ROLES = {"claude": _claude_role, "codex": _codex_role, "opencode": _opencode_role}
_MCP = {"claude": _claude_mcp, "codex": _codex_mcp, "opencode": _opencode_mcp}
