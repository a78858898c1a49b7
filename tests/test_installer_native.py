"""Prompts, roles and extensions as each agent takes them (reefd/harness/native.py), and the installer placing them
in the agent's own folders and config, asking before it enables an extension. The agents are stubs that log their
arguments; tests/test_agent_clis.py runs the real Claude Code, Codex and opencode on what lands."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pexpect
import pytest

from reefd.harness import Harness
from reefd.harness.installer import installer
from reefd.harness.native import extensions, placed, toml_str
from tests.test_installer import HARNESS_V1, SCENARIO, Box, harness, ok

ROLE = ("---\nname: reviewer\ndescription: Reviews diffs before a commit\ntools: [Read, Grep, LS]\n---\n\n"
        "Review the diff. Quote the lines you mean.\n")
GIT = "type: mcp\ncommand: [uvx, mcp-server-git, --repository, .]\nenv: {GIT_PAGER: cat}\n"
DOCS = "type: mcp\nurl: https://docs.example.com/mcp\ndescription: The team's docs\n"
LINT = "type: hook\nevent: PostToolUse\nmatcher: Edit|Write\ncommand: [ruff, check, \"it's here\"]\n"
FULL = {**HARNESS_V1, "roles/reviewer.md": ROLE, "extensions/git.yaml": GIT, "extensions/docs.yaml": DOCS,
        "extensions/lint.yaml": LINT}
R1 = harness("r1-aaaaaaa", FULL)
AGENTS = ("claude", "codex", "opencode")
# Where each agent reads commands and subagents (relative to HOME), and what the prompt and the role become there.
COMMAND = {"claude": ".claude/commands/greet.md", "codex": ".codex/prompts/greet.md",
           "opencode": ".config/opencode/commands/greet.md"}
SUBAGENT = {"claude": ".claude/agents/reviewer.md", "codex": ".codex/agents/reviewer.toml",
            "opencode": ".config/opencode/agents/reviewer.md"}
GREET = "---\ndescription: Greet with 'hi' \\o/\n---\n\nGreet with 'hi' \\o/\n"
ASKED = {"claude": ["docs", "git", "lint"], "codex": ["docs", "git", "lint"], "opencode": ["docs", "git"]}


@pytest.fixture
def box(tmp_path: Path) -> Box:
    """A Box whose agents also append each command line they get to calls.jsonl."""
    b = Box(tmp_path)
    for name in ("claude", "codex", "opencode"):
        (b.bin / name).write_text(
            f"#!{sys.executable}\nimport json, os, sys\n"
            f"with open({str(tmp_path / 'calls.jsonl')!r}, 'a') as f:\n"
            f"    f.write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
            "if sys.argv[1:2] != ['mcp']:\n"
            "    print('STUB STARTED', flush=True)\n"
            "    json.dump({'argv': sys.argv, 'env': dict(os.environ)}, open(os.environ['STUB_OUT'], 'w'))\n")
    return b


def calls(box: Box) -> list[list[str]]:
    path = box.root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def asked(box: Box, adapter: str, answers: dict[str, str], h: dict = R1) -> str:
    """Runs the installer as `curl | sh` on a terminal: the script on stdin, the questions on /dev/tty."""
    (box.root / "install.sh").write_text(installer(adapter, SCENARIO, "http://127.0.0.1:9", h))
    child = pexpect.spawn("sh", ["-c", f"sh < {box.root / 'install.sh'}"], env=box.env, encoding="utf-8",
                          timeout=30)
    seen = []
    while child.expect([r"\n  (\w+): [^\r]*\r\nEnable it\? \[y/N\] ", pexpect.EOF]) == 0:
        seen.append(child.match.group(1))
        child.sendline(answers[child.match.group(1)])
    child.close()
    assert child.exitstatus == 0, child.before
    return " ".join(seen)


def toml(box: Box) -> dict:
    return tomllib.loads(box.read(".codex/config.toml"))


def enabled(box: Box, adapter: str) -> set[str]:
    """The extensions the agent's own config now enables."""
    if adapter == "claude":
        added = {c[5] for c in calls(box) if c[1:4] == ["mcp", "add-json", "--scope"]}
        removed = {c[5] for c in calls(box) if c[1:4] == ["mcp", "remove", "--scope"]}
        settings = box.data("claude") / "settings.json"
        hooks = {"lint"} if settings.exists() and "ruff" in settings.read_text() else set()
        return (added - removed) | hooks
    if adapter == "codex":
        config = toml(box) if (box.home / ".codex/config.toml").exists() else {}
        return set(config.get("mcp_servers", {})) | ({"lint"} if "hooks" in config else set())
    return set(json.loads((box.data("opencode") / "opencode.json").read_text()).get("mcp", {}))


# --- what each agent's files say ----------------------------------------------------------------------------


def test_each_agent_gets_the_prompt_as_a_command_and_the_role_as_a_subagent_in_its_own_format() -> None:
    h = Harness.from_files(FULL)
    files = {a: {f"{p.place}/{p.name}": p.text for p in placed(a, h)} for a in AGENTS}
    assert files["claude"] == {"commands/greet.md": GREET, "agents/reviewer.md": (
        "---\nname: reviewer\ndescription: Reviews diffs before a commit\ntools: Read, Grep, LS\n---\n\n"
        "Review the diff. Quote the lines you mean.\n")}
    assert tomllib.loads(files["codex"]["agents/reviewer.toml"]) == {
        "name": "reviewer", "description": "Reviews diffs before a commit",
        "developer_instructions": "Review the diff. Quote the lines you mean.\n\n"
                                  "Use only these tools: Read, Grep, LS."}
    assert files["opencode"]["agents/reviewer.md"] == (
        "---\ndescription: Reviews diffs before a commit\nmode: subagent\ntools:\n  '*': false\n  read: true\n"
        "  grep: true\n  list: true\n---\n\nReview the diff. Quote the lines you mean.\n")
    assert files["codex"]["commands/greet.md"] == files["opencode"]["commands/greet.md"] == GREET
    assert placed("generic", h) == []


def test_each_agent_gets_the_extensions_as_its_own_config_entries() -> None:
    h = Harness.from_files(FULL)
    claude = {x.id: (x.form, x.text) for x in extensions("claude", h)}
    assert claude["git"] == ("mcp.json", json.dumps({"type": "stdio", "command": "uvx", "args": [
        "mcp-server-git", "--repository", "."], "env": {"GIT_PAGER": "cat"}}))
    assert json.loads(claude["docs"][1]) == {"type": "http", "url": "https://docs.example.com/mcp"}
    assert claude["lint"][0] == "hook.PostToolUse.json" and json.loads(claude["lint"][1]) == {
        "matcher": "Edit|Write", "hooks": [{"type": "command", "command": "ruff check 'it'\"'\"'s here'"}]}
    codex = tomllib.loads("\n".join(x.text for x in extensions("codex", h)))
    assert codex["mcp_servers"] == {"docs": {"url": "https://docs.example.com/mcp"}, "git": {
        "command": "uvx", "args": ["mcp-server-git", "--repository", "."], "env": {"GIT_PAGER": "cat"}}}
    assert codex["hooks"] == {"PostToolUse": [{"matcher": "Edit|Write", "hooks": [
        {"type": "command", "command": "ruff check 'it'\"'\"'s here'"}]}]}
    opencode = {x.id: x for x in extensions("opencode", h)}
    assert json.loads("{" + opencode["git"].text + "}") == {"git": {
        "type": "local", "command": ["uvx", "mcp-server-git", "--repository", "."], "enabled": True,
        "environment": {"GIT_PAGER": "cat"}}}
    assert opencode["lint"].form == "" and "JavaScript plugins" in opencode["lint"].why_not
    assert opencode["docs"].shown == "docs: MCP server at https://docs.example.com/mcp - The team's docs"
    assert extensions("generic", h) == []


def test_a_hook_event_codex_lacks_has_no_place_there() -> None:
    h = Harness.from_files({"extensions/note.yaml": "type: hook\nevent: Notification\ncommand: [notify-send]\n"})
    [x] = extensions("codex", h)
    assert (x.form, x.why_not) == ("", "Codex has no Notification hook event")


@pytest.mark.parametrize("text", ['quote " and \\ back', "tab\tnew\nline", "ünï 💡", "del \x7f", "ctl \x01"])
def test_toml_strings_read_back_as_written(text: str) -> None:
    assert tomllib.loads(f"v = {toml_str(text)}")["v"] == text


# --- the installer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", AGENTS)
def test_commands_and_subagents_land_and_uninstall_leaves_the_users_own(box: Box, adapter: str) -> None:
    for rel in (COMMAND[adapter], SUBAGENT[adapter]):  # the user's own, beside where Reef's go
        mine = box.home / rel.replace("greet", "mine").replace("reviewer", "mine")
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text("my own\n")
    before = box.tree()
    proc = ok(box.install(adapter, R1))
    assert box.read(COMMAND[adapter]) == GREET
    assert "Review the diff." in box.read(SUBAGENT[adapter])
    assert f"  command: {box.home / COMMAND[adapter]}\n  subagent: {box.home / SUBAGENT[adapter]}\n" in proc.stdout
    once = box.tree()
    ok(box.install(adapter, R1))
    assert box.tree() == once  # idempotent
    ok(box.wrapper("uninstall"))
    assert box.tree() == before


def test_a_users_own_subagent_of_the_same_name_is_refused_and_nothing_changes(box: Box) -> None:
    (box.home / ".claude/agents").mkdir(parents=True)
    (box.home / ".claude/agents/reviewer.md").write_text("my reviewer\n")
    before = box.tree()
    proc = box.install("claude", R1)
    assert proc.returncode != 0
    assert f"{box.home}/.claude/agents/reviewer.md already exists and is not Reef's" in proc.stderr
    assert box.tree() == before


@pytest.mark.parametrize("adapter", AGENTS)
def test_a_non_interactive_install_never_enables_an_extension(box: Box, adapter: str) -> None:
    proc = ok(box.install(adapter, R1))  # no terminal: stdin is the script, and there is no /dev/tty
    assert enabled(box, adapter) == set()
    assert not [c for c in calls(box) if c[1:2] == ["mcp"]]
    assert f"not enabled, waiting for your yes: {' '.join(ASKED[adapter])} ('reef-hello extensions'" in proc.stderr
    if adapter == "opencode":
        assert "extension lint is not enabled: opencode runs hooks as JavaScript plugins" in proc.stderr


@pytest.mark.parametrize("adapter", AGENTS)
def test_on_a_terminal_each_new_extension_is_shown_and_only_a_yes_enables_it(box: Box, adapter: str) -> None:
    assert asked(box, adapter, {"git": "y", "docs": "n", "lint": "yes"}) == " ".join(ASKED[adapter])
    assert enabled(box, adapter) == {"git", "lint"} - ({"lint"} if adapter == "opencode" else set())
    if adapter == "claude":
        [add] = [c for c in calls(box) if c[1:3] == ["mcp", "add-json"]]
        assert add[3:6] == ["--scope", "user", "git"]
        assert json.loads(add[6])["args"] == ["mcp-server-git", "--repository", "."]
        ok(box.wrapper("-p", "hi"))
        argv = box.stub()["argv"]
        assert argv[1:4] == ["--settings", str(box.data("claude") / "settings.json"), "-p"]
    if adapter == "codex":
        assert toml(box)["mcp_servers"]["git"]["env"] == {"GIT_PAGER": "cat"}
    n_calls = len(calls(box))
    assert asked(box, adapter, {}) == ""  # the same release again: nothing new to ask, nothing called
    assert len(calls(box)) == n_calls


def test_a_changed_extension_is_asked_again_and_without_a_yes_it_goes(box: Box) -> None:
    asked(box, "codex", {"git": "y", "docs": "n", "lint": "n"})
    changed = harness("r2-bbbbbbb", {**FULL, "extensions/git.yaml": GIT.replace("cat", "less")})
    ok(box.install("codex", changed))  # no terminal: the changed git waits for a yes, so it leaves the config
    assert enabled(box, "codex") == set()
    assert asked(box, "codex", {"git": "y"}, changed) == "git"  # only the changed one is asked about
    assert toml(box)["mcp_servers"]["git"]["env"] == {"GIT_PAGER": "less"}


@pytest.mark.parametrize("adapter", AGENTS)
def test_extensions_are_turned_on_and_off_by_name(box: Box, adapter: str) -> None:
    ok(box.install(adapter, R1))
    listing = ok(box.wrapper("extensions", "enable", "git")).stdout
    assert "on          git: MCP server, runs: uvx mcp-server-git --repository . with GIT_PAGER set\n" in listing
    assert "not-asked   docs: MCP server at https://docs.example.com/mcp - The team's docs\n" in listing
    assert enabled(box, adapter) == {"git"}
    ok(box.wrapper("extensions", "disable", "git"))
    assert enabled(box, adapter) == set()
    refused = box.wrapper("extensions", "enable", "nope")
    assert refused.returncode != 0 and "release r1-aaaaaaa has no extension nope" in refused.stderr


def test_codex_keeps_a_users_own_server_of_the_same_name_and_uninstall_gives_its_file_back(box: Box) -> None:
    (box.home / ".codex").mkdir()
    mine = 'model = "o3"\n\n[mcp_servers.git]\ncommand = "my-git-server"\n'
    (box.home / ".codex/config.toml").write_text(mine)
    ok(box.install("codex", R1))
    proc = ok(box.wrapper("extensions", "enable", "git", "lint"))
    assert "MCP server git is not enabled: " in proc.stderr and "has its own [mcp_servers.git]" in proc.stderr
    config = toml(box)
    assert config["mcp_servers"] == {"git": {"command": "my-git-server"}} and "PostToolUse" in config["hooks"]
    ok(box.wrapper("uninstall"))
    assert box.read(".codex/config.toml") == mine


def test_uninstall_takes_out_the_mcp_servers_reef_added_to_claude_code(box: Box) -> None:
    ok(box.install("claude", R1))
    ok(box.wrapper("extensions", "enable", "git", "docs"))
    ok(box.wrapper("uninstall"))
    removed = sorted(c[5] for c in calls(box) if c[1:3] == ["mcp", "remove"])
    assert removed == ["docs", "git"]
    assert not box.data("claude").exists()
