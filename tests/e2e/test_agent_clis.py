"""The real Claude Code, Codex and opencode, offline, on what the harness installer placed: each agent's own CLI
shows Reef's subagent, command, MCP server and hook beside the user's own entries, and after `uninstall` only the
user's own. No model answers: Claude Code shows what a session loaded only in its first event (`init`), so that
run goes to a closed port and is stopped at that event; the others list from their config alone.

What no CLI here can list without a model call: Codex's custom prompts (/prompts:NAME) and hooks, and opencode's
commands other than through `opencode debug config` (used below). make test installs the CLIs (make agent-clis).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from reefd.harness.installer import installer
from tests.test_installer import SCENARIO, harness, ok
from tests.test_installer_native import FULL

CLIS = Path(os.environ.get("REEF_AGENT_CLIS", "/nonexistent"))
pytestmark = pytest.mark.skipif(not (CLIS / "claude").exists(), reason="the agents' CLIs are not installed "
                                "(make agent-clis, which make test runs, installs them with npm)")
# A hook an offline session shows it ran: Claude Code starts SessionStart hooks before its init event.
STARTED = "type: hook\nevent: SessionStart\ncommand: [touch, {flag}]\n"


class Home:
    """A temporary HOME with the real CLIs first on PATH, a closed port for reefd, and helpers to run them."""

    def __init__(self, root: Path) -> None:
        self.root, self.home = root, root / "home"
        self.home.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
        self.env = {"HOME": str(self.home), "PATH": f"{CLIS}:/usr/local/bin:/usr/bin:/bin", "REEF_TOKEN": "t",
                    "LANG": "C.UTF-8", "OPENCODE_DISABLE_MODELS_FETCH": "1", "DISABLE_AUTOUPDATER": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "TMPDIR": str(root)}

    def run(self, *argv: str, stderr: bool = True, **env: str) -> str:
        """What the command printed (stdout, then stderr unless told not to); it must succeed."""
        proc = subprocess.run(argv, env={**self.env, **env}, cwd=self.root, capture_output=True, text=True,
                              timeout=120, check=False, start_new_session=True)
        assert proc.returncode == 0, f"{argv}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout + (proc.stderr if stderr else "")

    def install(self, adapter: str, files: dict[str, str]) -> None:
        script = installer(adapter, SCENARIO, self.url, harness("r1-aaaaaaa", files))
        ok(subprocess.run(["sh"], input=script, env=self.env, capture_output=True, text=True, timeout=120,
                          check=False, start_new_session=True))

    def wrapper(self, *args: str) -> str:
        return self.run(str(self.home / ".local/bin/reef-hello"), *args)

    def mine(self, rel: str, text: str) -> None:
        path = self.home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def box(tmp_path: Path) -> Home:
    return Home(tmp_path)


def claude_init(box: Home, *argv: str, **env: str) -> tuple[dict[str, Any], list[str]]:
    """The init event of a `claude -p` session (`argv` starts it), and the hooks it ran before that event."""
    hooks: list[str] = []
    with subprocess.Popen([*argv, "-p", "hi", "--output-format", "stream-json", "--verbose"],
                          env={**box.env, **env}, cwd=box.root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, start_new_session=True) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                event = json.loads(line)
                if event.get("subtype") == "hook_started":
                    hooks.append(event["hook_event"])
                if event.get("subtype") == "init":
                    return event, hooks
            raise AssertionError("claude ended before its init event")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)


def test_claude_code_loads_reefs_subagent_command_mcp_server_and_hook(box: Home) -> None:
    claude = str(CLIS / "claude")
    box.run(claude, "mcp", "add-json", "--scope", "user", "mine", '{"type": "stdio", "command": "my-server"}')
    box.mine(".claude/agents/helper.md", "---\nname: helper\ndescription: mine\n---\n\nMine.\n")
    flag = box.root / "session-started"
    box.install("claude", {**FULL, "extensions/started.yaml": STARTED.format(flag=flag)})
    box.wrapper("extensions", "enable", "git", "started")

    listed = box.run(claude, "mcp", "list")
    assert "git: uvx mcp-server-git --repository ." in listed and "mine: my-server" in listed
    init, hooks = claude_init(box, str(box.home / ".local/bin/reef-hello"))  # pointed at the closed port
    assert {"reviewer", "helper"} <= set(init["agents"]) and "greet" in init["slash_commands"]
    assert {"git", "mine"} <= {s["name"] for s in init["mcp_servers"]}
    assert "SessionStart" in hooks and flag.exists()  # Reef's hook, from the settings the wrapper passes

    box.wrapper("uninstall")
    listed = box.run(claude, "mcp", "list")
    assert "mine: my-server" in listed and "git:" not in listed
    init, _ = claude_init(box, claude, ANTHROPIC_BASE_URL=box.url, ANTHROPIC_API_KEY="x")
    assert "helper" in init["agents"] and "reviewer" not in init["agents"] and "greet" not in init["slash_commands"]


def test_codex_lists_reefs_mcp_server_and_subagent(box: Home) -> None:
    codex = str(CLIS / "codex")
    mine = '[mcp_servers.mine]\ncommand = "my-server"\n'
    box.mine(".codex/config.toml", mine)
    box.install("codex", FULL)
    box.wrapper("extensions", "enable", "git", "lint")

    listed = box.run(codex, "mcp", "list")
    assert "git " in listed and "mcp-server-git --repository ." in listed and "mine " in listed
    prompt = box.run(codex, "debug", "prompt-input", "hi")  # what the model would be given: roles, AGENTS.md
    assert "reviewer: {\\nReviews diffs before a commit\\n}" in prompt and "Use tabs, not $SPACES." in prompt

    box.wrapper("uninstall")
    listed = box.run(codex, "mcp", "list")
    assert "mine " in listed and "git " not in listed
    assert "reviewer: {" not in box.run(codex, "debug", "prompt-input", "hi")
    assert (box.home / ".codex/config.toml").read_text() == mine


def test_opencode_lists_reefs_subagent_command_and_mcp_server(box: Home) -> None:
    opencode = str(CLIS / "opencode")
    box.mine(".config/opencode/agents/helper.md", "---\ndescription: mine\nmode: subagent\n---\n\nMine.\n")
    box.install("opencode", FULL)
    box.wrapper("extensions", "enable", "git")
    config = {"OPENCODE_CONFIG": str(box.home / ".local/share/reef/hello/opencode/opencode.json")}

    agents = box.run(opencode, "agent", "list")
    assert "reviewer (subagent)" in agents and "helper (subagent)" in agents
    assert "git" in box.run(opencode, "mcp", "list", **config)
    resolved = json.loads(box.run(opencode, "debug", "config", stderr=False, **config))
    assert "greet" in resolved["command"] and resolved["mcp"]["git"]["command"][0] == "uvx"

    box.wrapper("uninstall")
    agents = box.run(opencode, "agent", "list")
    assert "helper (subagent)" in agents and "reviewer" not in agents
