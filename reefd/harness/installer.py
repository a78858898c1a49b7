"""The harness installer: one self-contained POSIX sh script per coding agent, with the harness files inline.

Owns where each agent reads its instructions, skills, commands, subagents and extension config, how its wrapper
points it at reefd, and the marked blocks, manifest and releases folder that keep a user's own files untouched;
knows nothing about HTTP, the release chain or how harnesses are made (reefd/api/delivery.py serves the script,
reefd/harness/__init__.py renders the files, native.py each agent's own formats). The shell itself lives in
sh/*.sh beside this module, each file clean under `shellcheck -s sh` on its own; this module checks the input,
quotes the constants, and joins the fragments and the harness files into a script.

How a fragment becomes script text (_sh): installer_head.sh and wrapper_head.sh are taken whole, with only
{scenario}, {release}, {title} and {adapter} filled in (any other brace stays as it is). Every other fragment
starts with a header for shellcheck and readers (`# shellcheck shell=sh`, then comments saying which variables
and functions come from elsewhere, then a blank line), which is dropped, as is every line that is only a
`# shellcheck ...` directive.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from reefd.harness import Harness, HarnessError, native

ADAPTERS = ("claude", "codex", "opencode", "generic")

_SCENARIO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # reefd's scenario names
_RELEASE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PART = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"  # no leading dot: no "..", no hidden files
_PATH_RE = re.compile(rf"{_PART}(?:/{_PART}){{0,7}}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_URL_RE = re.compile(r"https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~!$&()*+,;=:@%/-]*)?")
_SKILL_NAME_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")  # the Agent Skills standard's names


@dataclass(frozen=True)
class _Agent:
    """Where the agent reads each kind, as sh expressions (user-level folders; "" where it has none)."""

    title: str
    instructions: str  # the instructions file Reef's block goes in
    skills: str  # the skills folder
    commands: str = '""'  # the prompts, as its commands (native.py renders them)
    agents: str = '""'  # the roles, as its subagents
    toml: str = '""'  # Codex: the config.toml whose Reef block holds MCP servers and hooks
    # launch(), which runs the agent ("$@": its arguments; $SESSION: this run), is sh/launch_<adapter>.sh


_CLAUDE = "${CLAUDE_CONFIG_DIR:-$HOME/.claude}"
_CODEX = "${CODEX_HOME:-$HOME/.codex}"
_OPENCODE = "${XDG_CONFIG_HOME:-$HOME/.config}/opencode"
_AGENTS = {
    # code.claude.com docs: memory, skills, slash commands, subagents under ~/.claude
    "claude": _Agent("Claude Code", f'"{_CLAUDE}/CLAUDE.md"', f'"{_CLAUDE}/skills"', f'"{_CLAUDE}/commands"',
                     f'"{_CLAUDE}/agents"'),
    # developers.openai.com/codex: $CODEX_HOME (default ~/.codex) AGENTS.md, prompts/, agents/, config.toml;
    # skills in $HOME/.agents/skills
    "codex": _Agent("Codex CLI", f'"{_CODEX}/AGENTS.md"', '"$HOME/.agents/skills"', f'"{_CODEX}/prompts"',
                    f'"{_CODEX}/agents"', f'"{_CODEX}/config.toml"'),
    # opencode.ai/docs: rules, skills, commands and agents under ~/.config/opencode
    "opencode": _Agent("opencode", f'"{_OPENCODE}/AGENTS.md"', f'"{_OPENCODE}/skills"', f'"{_OPENCODE}/commands"',
                       f'"{_OPENCODE}/agents"'),
    "generic": _Agent("any OpenAI- or Anthropic-SDK agent", '"$ADATA/AGENTS.md"', '"$ADATA/harness/skills"'),
}

_NATIVE_FOLDERS = ("prompts/", "roles/", "extensions/")  # the kinds an agent loads itself (native.py)
_HEADER = "# shellcheck shell=sh\n"  # the first line of a fragment's header (see the module's docstring)
_DIRECTIVE_RE = re.compile(r"(?m)^[ \t]*# shellcheck [^\n]*\n")
_FIELD_RE = re.compile(r"\{(scenario|release|title|adapter)\}")


@functools.cache
def _sh(name: str) -> str:
    """The script text of fragment sh/`name`: its header and shellcheck directives dropped."""
    text = resources.files("reefd.harness").joinpath("sh", name).read_text(encoding="utf-8")
    if text.startswith(_HEADER):
        text = text[text.index("\n\n") + 2:]
    return _DIRECTIVE_RE.sub("", text)


def _head(name: str, **fields: str) -> str:
    """installer_head.sh or wrapper_head.sh with its {field}s filled in."""
    return _FIELD_RE.sub(lambda m: fields[m.group(1)], _sh(name))


def installer(adapter: str, scenario: str, base_url: str, harness: dict[str, Any]) -> str:
    """The sh installer for `adapter` with `harness` (GET /reef/harness's JSON) inline; ValueError on bad input.

    The script writes only under $HOME, checks every file's sha256 before anything is moved into place, keeps
    each release under ~/.local/share/reef/<scenario>/<adapter>/releases/ and installs ~/.local/bin/reef-<scenario>,
    the wrapper that starts the agent pointed at reefd. No token is ever written: it comes from $REEF_TOKEN.
    """
    if adapter not in _AGENTS:
        raise ValueError(f"unknown adapter {adapter!r}; known adapters: {', '.join(ADAPTERS)}")
    if not _SCENARIO_RE.fullmatch(scenario) or ".." in scenario:
        raise ValueError(f"invalid scenario name {scenario!r}")
    url = base_url.rstrip("/")
    if not _URL_RE.fullmatch(url):
        raise ValueError(f"invalid base URL {base_url!r}: want http(s)://host[:port][/path]")
    release = harness.get("release")
    if not isinstance(release, str) or not _RELEASE_RE.fullmatch(release):
        raise ValueError(f"invalid harness release id {release!r}")
    files = _files(harness)
    agent = _AGENTS[adapter]
    consts = _consts(scenario=scenario, adapter=adapter, base_url=url)
    wrapper = "\n".join([_head("wrapper_head.sh", scenario=scenario, title=agent.title), consts, _paths(agent),
                         _sh("common.sh"), _sh("native.sh"), _sh("wrapper.sh"), _sh(f"launch_{adapter}.sh"),
                         'main "$@"\n'])
    staged: list[tuple[str, str]] = [(f"release/harness/{path}", text) for path, _, text in files]
    staged.append(("release/instructions.md", _instructions(files)))
    staged += _native(adapter, files)
    staged.append(("wrapper", wrapper))
    if adapter == "opencode":
        staged.append(("release/opencode.json", _opencode_json(scenario, url)))
    checks = {f"release/harness/{path}": sha for path, sha, _ in files}
    delim = _delimiter([text for _, text in staged])
    unpack = [_unpack(name, checks.get(name) or _sha(text), text, delim) for name, text in staged]
    notes = [f'  say "note: skill {p.split("/")[1]!r} is not a lowercase-hyphenated name; agents may skip it"'
             for p, _, _ in files if p.startswith("skills/") and not _SKILL_NAME_RE.fullmatch(p.split("/")[1])]
    return "\n".join([
        _head("installer_head.sh", scenario=scenario, release=release, title=agent.title, adapter=adapter),
        consts + f"RELEASE={_q(release)}\n", _paths(agent), _sh("common.sh"), _sh("native.sh"), _sh("installer.sh"),
        "stage_files() {\n" + "".join(unpack) + "}\n", "notes() {\n" + "".join(n + "\n" for n in notes) + "  :\n}\n",
        'main "$@"\n'])


def _files(harness: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(path, sha256, content) of each harness file, paths checked so none can leave the harness folder."""
    out = []
    for f in harness.get("files") or []:
        path, sha, content = f.get("path"), f.get("sha256"), f.get("content")
        if not isinstance(path, str) or not _PATH_RE.fullmatch(path):
            raise ValueError(f"invalid harness file path {path!r}")
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha) or not isinstance(content, str):
            raise ValueError(f"harness file {path}: needs a hex sha256 and a text content")
        out.append((path, sha, content))
    return sorted(out)


def _instructions(files: list[tuple[str, str, str]]) -> str:
    """What goes inside the marked block: the rules, a blank line between files (prompts go as commands).

    A line that looks like a Reef marker gets a leading space (Markdown still reads it as a comment), so a block
    always ends at its own end marker.
    """
    parts = [t if t.endswith("\n") else t + "\n"
             for p, _, t in files if p.startswith("rules/") and p.endswith(".md") and "/" not in p[len("rules/"):]]
    text = "\n".join(p for p in parts if p.strip())
    return re.sub(r"(?m)^(?=<!-- reef:)", " ", text)


def _native(adapter: str, files: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """The release folder's place/ (commands, subagents) and ext/<id>/ (each extension as the agent takes it)."""
    try:
        parsed = Harness.from_files({path: text for path, _, text in files if path.startswith(_NATIVE_FOLDERS)})
    except HarnessError as e:
        raise ValueError(f"harness file {e}") from None
    out = [(f"release/place/{p.place}/{p.name}", p.text) for p in native.placed(adapter, parsed)]
    for x in native.extensions(adapter, parsed):
        out.append((f"release/ext/{x.id}/shown", x.shown + "\n"))
        text = x.text if x.form else x.why_not
        out.append((f"release/ext/{x.id}/{x.form or 'none'}", text if text.endswith("\n") else text + "\n"))
    return out


def _opencode_json(scenario: str, url: str) -> str:
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "Reef",
                "options": {"baseURL": f"{url}/v1", "apiKey": "{env:REEF_TOKEN}",
                            "headers": {"x-reef-scenario": scenario, "x-reef-session": "{env:REEF_SESSION}"}},
                "models": {scenario: {}}}
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"reef": provider},
              "model": f"reef/{scenario}", "small_model": f"reef/{scenario}"}
    return json.dumps(config, indent=2) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _consts(**values: str) -> str:
    return "".join(f"{k.upper()}={_q(v)}\n" for k, v in values.items()) + 'PROG="reef-$SCENARIO"\n'


def _paths(agent: _Agent) -> str:
    return f"""paths() {{  # where this agent reads its files, and where Reef keeps its own
  DATA=$HOME/.local/share/reef/$SCENARIO BIN=$HOME/.local/bin
  ADATA=$DATA/$ADAPTER LEDGER=$HOME/.local/share/reef/created
  INSTR_DEFAULT={agent.instructions} SKILLS_DEFAULT={agent.skills}
  COMMANDS_DEFAULT={agent.commands} AGENTS_DEFAULT={agent.agents} TOML_DEFAULT={agent.toml}
}}
"""


def _delimiter(texts: list[str]) -> str:
    """A heredoc delimiter that is no line of any text; quoted (<<'DELIM'), it keeps the shell from expanding."""
    lines = {line for t in texts for line in t.split("\n")}
    seed = _sha("".join(texts))[:16].upper()
    n = 0
    while (delim := f"REEF_EOF_{seed}_{n}") in lines:
        n += 1
    return delim


def _unpack(name: str, sha: str, text: str, delim: str) -> str:
    """A heredoc with the exact text: a text without a final newline gets one, which `unpack ... 1` drops."""
    strip = "0" if text.endswith("\n") or not text else "1"
    body = text if strip == "0" else text + "\n"
    return f"  unpack {_q(name)} {sha} {strip} <<'{delim}'\n{body}{delim}\n"
