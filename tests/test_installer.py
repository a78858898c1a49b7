"""reefd/harness/installer.py: the sh installer and the reef-NAME wrapper it writes, run for real under a
temporary HOME; and its sh/*.sh fragments, each shellchecked on its own.

The scripts run with /bin/sh against a fake reefd: a real HTTP server on loopback that serves the harness
contract's endpoints (releases, install, records, report) and records what it was sent. The agents are stubs on
PATH that write down their arguments and environment. tests/e2e/test_harness.py drives the real daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pexpect
import pytest

import reefd.harness
from reefd.harness.installer import ADAPTERS, installer
from tests.served import in_thread

TOKEN = "reef-secret-9f3c2a71d04e"  # a value that must never land in any file
SCENARIO = "hello"
SKILL = "---\nname: deploy\ndescription: Ship a build\n---\n\nRun `make deploy`; never push on Fridays.\n"
HARNESS_V1 = {"rules/style.md": "Use tabs, not $SPACES.\n", "prompts/greet.md": "Greet with 'hi' \\o/",
              "skills/deploy/SKILL.md": SKILL, "config.yaml": "temperature: 0.2\n"}
HARNESS_V2 = {"rules/style.md": "Use four spaces.\n", "rules/tests.md": "Run the tests first.\n",
              "skills/review/SKILL.md": SKILL.replace("deploy", "review"), "config.yaml": "temperature: 0.1\n"}
USER_NOTES = "# My own notes\n\nAlways answer in French.\n"
# Where each adapter's agent reads the files (relative to HOME), and its instructions file.
SKILLS = {"claude": ".claude/skills", "codex": ".agents/skills", "opencode": ".config/opencode/skills"}
INSTRUCTIONS = {"claude": ".claude/CLAUDE.md", "codex": ".codex/AGENTS.md", "opencode": ".config/opencode/AGENTS.md"}
AGENTS = tuple(SKILLS)


def harness(release: str, files: dict[str, str], summary: str = "", parent: str | None = None) -> dict[str, Any]:
    return {"scenario": SCENARIO, "release": release, "parent": parent, "kind": "harness", "summary": summary,
            "created_at": "2026-11-29T10:00:00Z",
            "files": [{"path": p, "sha256": hashlib.sha256(c.encode()).hexdigest(), "size": len(c.encode()),
                       "content": c} for p, c in sorted(files.items())]}


R1 = harness("r1-aaaaaaa", HARNESS_V1, "first harness")
R2 = harness("r2-bbbbbbb", HARNESS_V2, 'naïve "tests" rule\nsecond line', parent="r1-aaaaaaa")


class FakeReef(ThreadingHTTPServer):
    """GET /reef/harness/releases and /install, GET .../records?session=, POST /reef/report; token required."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.chain = [R1]  # oldest first
        self.current: str | None = None  # the release reefd serves; None: the newest
        self.records: list[dict[str, Any]] = []
        self.seen: list[tuple[str, str, dict[str, str], dict[str, str], Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/reef/harness/releases":
            data = [{"id": h["release"], "parent": h["parent"], "kind": "harness", "created_at": h["created_at"],
                     "summary": h["summary"]} for h in reversed(self.chain)]
            current = self.current or self.chain[-1]["release"]
            listing = {"object": "list", "scenario": SCENARIO, "current": current, "data": data}
            return 200, "application/json", json.dumps(listing).encode()  # ASCII escapes: \u00ef, \n
        if method == "GET" and path == "/reef/harness/install":
            script = installer(query["adapter"], query["scenario"], self.url, self.chain[-1])
            return 200, "text/x-shellscript", script.encode()
        if method == "GET" and path == f"/reef/scenarios/{SCENARIO}/records":
            mine = [r for r in self.records if r["session"] == query.get("session")]
            start = [r["id"] for r in mine].index(query["after"]) + 1 if "after" in query else 0
            page = mine[start:start + 2]  # pages of two, so three turns take two pages
            more = start + len(page) < len(mine)
            out = {"object": "list", "data": page, "has_more": more, "last_id": page[-1]["id"] if page else None}
            return 200, "application/json", json.dumps(out).encode()
        if method == "POST" and path == "/reef/report":
            return 200, "application/json", json.dumps({"object": "reef.report", "report_id": "rep-1"}).encode()
        return 404, "application/json", b'{"error": {"message": "no route", "type": "not_found_error"}}'


class _Handler(BaseHTTPRequestHandler):
    server: FakeReef

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        query = dict(parse_qsl(url.query))
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.seen.append((self.command, url.path, query, headers, json.loads(raw) if raw else None))
        if headers.get("authorization") != f"Bearer {TOKEN}":
            status, kind, data = 401, "application/json", b'{"error": {"message": "bad token"}}'
        else:
            status, kind, data = self.server.answer(self.command, url.path, query, json.loads(raw) if raw else None)
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def reef() -> Iterator[FakeReef]:
    server = FakeReef()
    with in_thread(server):
        yield server


@dataclass
class Box:
    """A temporary HOME with stub agents on PATH, and helpers to run scripts in it."""

    root: Path
    home: Path = field(init=False)
    bin: Path = field(init=False)

    def __post_init__(self) -> None:
        self.home, self.bin = self.root / "home", self.root / "stubs"
        self.home.mkdir()
        self.bin.mkdir()
        for name in ("claude", "codex", "opencode", "tool"):
            stub = self.bin / name
            stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                            "print('STUB STARTED', flush=True)\n"
                            "with open(os.environ['STUB_OUT'], 'w') as f:\n"
                            "    json.dump({'argv': sys.argv, 'env': dict(os.environ)}, f)\n")
            stub.chmod(0o755)

    @property
    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")}
        return {**keep, "HOME": str(self.home), "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
                "REEF_TOKEN": TOKEN, "STUB_OUT": str(self.root / "stub.json")}

    def install(self, adapter: str, h: dict[str, Any], url: str = "http://127.0.0.1:9",
                shell: str = "sh") -> subprocess.CompletedProcess[str]:
        script = installer(adapter, SCENARIO, url, h)  # piped, as `curl ... | sh` runs it
        return subprocess.run([shell], input=script, env=self.env, capture_output=True, text=True, timeout=60,
                              check=False, start_new_session=True)  # no terminal to ask on

    def wrapper(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.home / ".local/bin/reef-hello"), *args], env={**self.env, **env},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False,
                              start_new_session=True)

    def stub(self) -> dict[str, Any]:
        return json.loads((self.root / "stub.json").read_text())

    def tree(self) -> dict[str, Any]:
        """Every folder, file and link under HOME: files by mode and bytes, links by target."""
        out: dict[str, Any] = {}
        for p in sorted(self.home.rglob("*")):
            rel = str(p.relative_to(self.home))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = "dir" if p.is_dir() else (stat.S_IMODE(p.stat().st_mode), p.read_bytes())
        return out

    def read(self, rel: str) -> str:
        return (self.home / rel).read_text()

    def data(self, adapter: str) -> Path:
        return self.home / ".local/share/reef" / SCENARIO / adapter


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def block(release: str, text: str) -> str:
    return f"<!-- reef:{SCENARIO} begin release={release} -->\n{text}<!-- reef:{SCENARIO} end -->\n"


V1_TEXT = "Use tabs, not $SPACES.\n"  # the rules, a blank line between (prompts go as the agent's commands)
V2_TEXT = "Use four spaces.\n\nRun the tests first.\n"


def seed_user_files(box: Box, adapter: str) -> None:
    """The user's own instructions file and a skill of their own, before Reef comes."""
    (box.home / INSTRUCTIONS[adapter]).parent.mkdir(parents=True)
    (box.home / INSTRUCTIONS[adapter]).write_text(USER_NOTES)
    (box.home / SKILLS[adapter] / "mine").mkdir(parents=True)
    (box.home / SKILLS[adapter] / "mine/SKILL.md").write_text("---\nname: mine\ndescription: mine\n---\n")


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# --- the script itself -----------------------------------------------------------------------------------


def test_unknown_adapter_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown adapter 'cursor'; known adapters: claude, codex, opencode, generic"):
        installer("cursor", SCENARIO, "http://127.0.0.1:8900", R1)
    assert ADAPTERS == ("claude", "codex", "opencode", "generic")


@pytest.mark.parametrize(("field_", "value"), [("scenario", "../etc"), ("url", "http://h/'$(x)'"),
                                               ("path", "../../.bashrc"), ("path", "skills/.x/SKILL.md"),
                                               ("release", "r1;rm -rf ~")])
def test_unsafe_input_is_refused(field_: str, value: str) -> None:
    h = json.loads(json.dumps(R1))
    if field_ == "path":
        h["files"][0]["path"] = value
    if field_ == "release":
        h["release"] = value
    with pytest.raises(ValueError):
        installer("claude", value if field_ == "scenario" else SCENARIO,
                  value if field_ == "url" else "http://127.0.0.1:8900", h)


def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed (make venv installs it with apt-get)")
    return found


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_installer_and_wrapper_pass_shellcheck(box: Box, adapter: str) -> None:
    script = box.root / "install.sh"
    script.write_text(installer(adapter, SCENARIO, "http://127.0.0.1:8900", R1))
    ok(box.install(adapter, R1))
    for path in (script, box.home / ".local/bin/reef-hello"):
        checked = subprocess.run([shellcheck(), "-s", "sh", str(path)], capture_output=True, text=True, check=False)
        assert checked.returncode == 0, checked.stdout


def test_every_shell_fragment_passes_shellcheck_on_its_own() -> None:
    folder = Path(reefd.harness.__file__).parent / "sh"
    fragments = sorted(folder.glob("*.sh"))
    assert {f"launch_{a}.sh" for a in ADAPTERS} <= {p.name for p in fragments}
    checked = subprocess.run([shellcheck(), "-s", "sh", *map(str, fragments)], capture_output=True, text=True,
                             check=False)
    assert checked.returncode == 0, checked.stdout


# --- install, update, rollback, uninstall ------------------------------------------------------------------


@pytest.mark.parametrize("adapter", AGENTS)
def test_install_lands_where_the_agent_reads_and_uninstall_leaves_only_the_users_files(box: Box,
                                                                                        adapter: str) -> None:
    seed_user_files(box, adapter)
    before = box.tree()
    ok(box.install(adapter, R1))
    assert box.read(INSTRUCTIONS[adapter]) == USER_NOTES + block("r1-aaaaaaa", V1_TEXT)
    assert box.read(f"{SKILLS[adapter]}/deploy/SKILL.md") == SKILL
    assert box.read(f"{SKILLS[adapter]}/mine/SKILL.md").startswith("---\nname: mine")
    kept = box.data(adapter) / "releases/r1-aaaaaaa/harness"
    assert {str(p.relative_to(kept)): p.read_text() for p in kept.rglob("*") if p.is_file()} == HARNESS_V1
    assert (box.data(adapter) / "history").read_text() == "r1-aaaaaaa\n"
    assert os.access(box.home / ".local/bin/reef-hello", os.X_OK)
    once = box.tree()
    ok(box.install(adapter, R1))  # the same release again changes nothing
    assert box.tree() == once
    ok(box.wrapper("uninstall"))
    assert box.tree() == before


def test_generic_writes_only_under_reefs_data_folder(box: Box) -> None:
    ok(box.install("generic", R1))
    assert sorted(p.name for p in box.home.iterdir()) == [".local"]
    data = box.data("generic")
    assert (data / "AGENTS.md").read_text() == V1_TEXT
    assert {str(p.relative_to(data / "harness")): p.read_text()
            for p in (data / "harness").rglob("*") if p.is_file()} == HARNESS_V1
    ok(box.wrapper("uninstall"))
    assert box.tree() == {}


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_instructions_without_a_final_newline_come_back_byte_for_byte(box: Box, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    (box.home / ".claude").mkdir()
    (box.home / ".claude/CLAUDE.md").write_text("no final newline")
    before = box.tree()
    ok(box.install("claude", R1, shell=shell))
    assert box.read(".claude/CLAUDE.md") == "no final newline\n" + block("r1-aaaaaaa", V1_TEXT)
    ok(box.wrapper("uninstall"))
    assert box.tree() == before


def test_a_users_own_skill_of_the_same_name_is_refused_and_nothing_changes(box: Box) -> None:
    (box.home / ".claude/skills/deploy").mkdir(parents=True)
    (box.home / ".claude/skills/deploy/SKILL.md").write_text("my own deploy skill\n")
    before = box.tree()
    proc = box.install("claude", R1)
    assert proc.returncode != 0
    assert f"{box.home}/.claude/skills/deploy already exists and is not this harness's skill" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert box.tree() == before


def test_a_users_own_command_of_the_wrappers_name_is_refused(box: Box) -> None:
    (box.home / ".local/bin").mkdir(parents=True)
    (box.home / ".local/bin/reef-hello").write_text("#!/bin/sh\necho mine\n")
    before = box.tree()
    proc = box.install("claude", R1)
    assert proc.returncode != 0 and "is not Reef's wrapper" in proc.stderr
    assert box.tree() == before


def test_a_skill_of_another_reef_scenario_is_named(box: Box) -> None:
    ok(box.install("claude", R1))
    other = installer("claude", "other", "http://127.0.0.1:9", R1)
    proc = subprocess.run(["sh"], input=other, env=box.env, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "(Reef's scenario hello installed it)" in proc.stderr


def test_a_damaged_file_or_a_truncated_download_installs_nothing(box: Box) -> None:
    seed_user_files(box, "claude")
    before = box.tree()
    damaged = json.loads(json.dumps(R1))
    damaged["files"][0]["sha256"] = "0" * 64
    proc = box.install("claude", damaged)
    assert proc.returncode != 0 and "does not match its sha256" in proc.stderr
    assert box.tree() == before
    script = installer("claude", SCENARIO, "http://127.0.0.1:9", R1)
    for cut in (len(script) // 3, len(script) - 12):
        (box.root / "cut.sh").write_text(script[:cut])
        subprocess.run(["sh", str(box.root / "cut.sh")], env=box.env, capture_output=True, check=False)
        assert box.tree() == before


@pytest.mark.parametrize("adapter", AGENTS)
def test_update_keeps_the_previous_release_and_rollback_restores_it(box: Box, reef: FakeReef,
                                                                     adapter: str) -> None:
    seed_user_files(box, adapter)
    ok(box.install(adapter, R1, url=reef.url))
    instructions = box.home / INSTRUCTIONS[adapter]
    instructions.write_text(instructions.read_text() + "A line of mine after Reef's block.\n")
    at_r1 = box.tree()
    reef.chain.append(R2)
    ok(box.wrapper("update"))
    assert box.read(INSTRUCTIONS[adapter]) == (USER_NOTES + block("r2-bbbbbbb", V2_TEXT)
                                               + "A line of mine after Reef's block.\n")
    assert not (box.home / SKILLS[adapter] / "deploy").exists()
    assert box.read(f"{SKILLS[adapter]}/review/SKILL.md") == SKILL.replace("deploy", "review")
    assert (box.data(adapter) / "releases/r1-aaaaaaa").is_dir()
    assert (box.data(adapter) / "history").read_text() == "r1-aaaaaaa\nr2-bbbbbbb\n"
    ok(box.wrapper("rollback"))
    assert {k: v for k, v in box.tree().items() if "releases/r2" not in k} == at_r1
    rolled = box.wrapper("rollback")
    assert rolled.returncode != 0 and "no earlier harness" in rolled.stderr


# --- the wrapper --------------------------------------------------------------------------------------------


def test_claude_starts_pointed_at_reefd(box: Box, reef: FakeReef) -> None:
    ok(box.install("claude", R1, url=reef.url))
    proc = ok(box.wrapper("-p", "Say hi", ANTHROPIC_API_KEY="sk-ant-users-own"))
    assert proc.stderr == ""  # reefd serves the installed release: no notice
    seen, session = box.stub(), box.read(".local/share/reef/hello/last-session").strip()
    assert seen["argv"][1:] == ["-p", "Say hi"] and Path(seen["argv"][0]).name == "claude"
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == reef.url and env["ANTHROPIC_AUTH_TOKEN"] == TOKEN
    assert env["ANTHROPIC_CUSTOM_HEADERS"] == f"x-reef-scenario: hello\nx-reef-session: {session}"
    assert "ANTHROPIC_API_KEY" not in env
    assert len(session) == 36
    ok(box.wrapper())
    assert box.read(".local/share/reef/hello/last-session").strip() != session  # a fresh session per run
    assert [s[1] for s in reef.seen] == ["/reef/harness/releases"] * 2
    assert reef.seen[0][2] == {"scenario": SCENARIO}


def test_codex_gets_its_provider_through_config_overrides(box: Box, reef: FakeReef) -> None:
    ok(box.install("codex", R1, url=reef.url))
    ok(box.wrapper("exec", "Say hi"))
    seen, session = box.stub(), box.read(".local/share/reef/hello/last-session").strip()
    overrides = seen["argv"][1:-2]
    assert seen["argv"][-2:] == ["exec", "Say hi"]
    assert overrides == [x for pair in zip(["-c"] * 7, [
        'model_provider="reef"', 'model="hello"', 'model_providers.reef.name="Reef"',
        f'model_providers.reef.base_url="{reef.url}/v1"', 'model_providers.reef.wire_api="responses"',
        'model_providers.reef.env_key="REEF_TOKEN"',
        f'model_providers.reef.http_headers={{ "x-reef-scenario" = "hello", "x-reef-session" = "{session}" }}'],
        strict=True) for x in pair]
    assert seen["env"]["REEF_TOKEN"] == TOKEN


def test_opencode_gets_a_config_of_its_own_with_the_token_left_to_the_environment(box: Box, reef: FakeReef) -> None:
    ok(box.install("opencode", R1, url=reef.url))
    ok(box.wrapper("run", "Say hi"))
    env = box.stub()["env"]
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    assert env["OPENCODE_CONFIG"] == str(box.data("opencode") / "opencode.json")
    assert config["model"] == "reef/hello"
    assert config["provider"]["reef"]["options"] == {
        "baseURL": f"{reef.url}/v1", "apiKey": "{env:REEF_TOKEN}",
        "headers": {"x-reef-scenario": "hello", "x-reef-session": "{env:REEF_SESSION}"}}
    assert env["REEF_SESSION"] == box.read(".local/share/reef/hello/last-session").strip()


def test_generic_runs_the_command_with_openai_settings(box: Box, reef: FakeReef) -> None:
    ok(box.install("generic", R1, url=reef.url))
    ok(box.wrapper("tool", "--flag"))
    seen = box.stub()
    assert seen["argv"][1:] == ["--flag"]
    env = seen["env"]
    assert env["OPENAI_BASE_URL"] == f"{reef.url}/scenarios/hello/v1" and env["OPENAI_API_KEY"] == TOKEN
    assert env["REEF_SCENARIO"] == "hello" and env["REEF_HARNESS_DIR"] == str(box.data("generic") / "harness")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_token_is_in_no_file(box: Box, reef: FakeReef, adapter: str) -> None:
    ok(box.install(adapter, R1, url=reef.url))
    ok(box.wrapper("tool") if adapter == "generic" else box.wrapper())
    reef.chain.append(R2)
    ok(box.wrapper("update"))
    written = [p for p in box.home.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert written == []


def test_report_posts_the_receipts_of_the_last_session(box: Box, reef: FakeReef) -> None:
    ok(box.install("claude", R1, url=reef.url))
    ok(box.wrapper())
    session = box.read(".local/share/reef/hello/last-session").strip()
    reef.records = [{"id": f"01HZ{i}", "session": session, "messages": [{"role": "user", "content": 'a "q"'}]}
                    for i in range(3)] + [{"id": "01HZother", "session": "another"}]
    feedback = 'too "terse"\\ — try again\n\ttab'
    proc = ok(box.wrapper("report", "--score", "0.5", "--feedback", feedback))
    assert "Reported score 0.5 on 3 turn(s)" in proc.stdout
    posts = [s for s in reef.seen if s[0] == "POST"]
    assert len(posts) == 1
    _, path, _, headers, body = posts[0]
    assert path == "/reef/report" and headers["x-reef-scenario"] == "hello"
    assert body == {"score": 0.5, "feedback": feedback, "references": ["01HZ0", "01HZ1", "01HZ2"]}
    ok(box.wrapper("report", "--score=-1e-3"))
    assert [s for s in reef.seen if s[0] == "POST"][-1][4] == {"score": -0.001,
                                                               "references": ["01HZ0", "01HZ1", "01HZ2"]}


@pytest.mark.parametrize("args", [[], ["--score"], ["--score", "abc"], ["--score", "1", "--what"]])
def test_report_refuses_a_bad_command_line(box: Box, args: list[str]) -> None:
    ok(box.install("claude", R1))
    proc = box.wrapper("report", *args)
    assert proc.returncode != 0 and "reef-hello" in proc.stderr


def test_without_a_terminal_a_newer_harness_is_one_line_on_stderr(box: Box, reef: FakeReef) -> None:
    ok(box.install("claude", R1, url=reef.url))
    reef.chain.append(R2)
    proc = ok(box.wrapper("-p", "hi"))
    assert proc.stderr == ('reef-hello: a newer harness is available: r2-bbbbbbb (naïve "tests" rule); '
                           "'reef-hello update' installs it\n")
    assert proc.stdout == "STUB STARTED\n"
    assert box.read(".claude/CLAUDE.md") == block("r1-aaaaaaa", V1_TEXT)


def prompt(box: Box, reef: FakeReef, choice: str) -> pexpect.spawn:
    ok(box.install("claude", R1, url=reef.url))
    reef.chain.append(R2)
    child = pexpect.spawn(str(box.home / ".local/bin/reef-hello"), ["-p", "hi"], env=box.env, encoding="utf-8",
                          timeout=30)
    child.expect_exact('A newer harness is available: r2-bbbbbbb (naïve "tests" rule)\r\n')
    child.expect_exact("1) Update with reef-hello update\r\n2) Skip\r\n")
    child.expect_exact("Choose 1 or 2 [2]: ")
    child.sendline(choice)
    return child


def test_on_a_terminal_choice_1_updates_then_starts_the_agent(box: Box, reef: FakeReef) -> None:
    child = prompt(box, reef, "1")
    child.expect_exact("Installed Reef harness r2-bbbbbbb of scenario hello for claude (was r1-aaaaaaa")
    child.expect_exact("STUB STARTED")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert box.read(".claude/CLAUDE.md") == block("r2-bbbbbbb", V2_TEXT)
    assert box.stub()["argv"][1:] == ["-p", "hi"]


def test_on_a_terminal_choice_2_skips_and_starts_the_agent(box: Box, reef: FakeReef) -> None:
    child = prompt(box, reef, "2")
    child.expect_exact("STUB STARTED")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert box.read(".claude/CLAUDE.md") == block("r1-aaaaaaa", V1_TEXT)
    assert not any(s[1] == "/reef/harness/install" for s in reef.seen)


def test_with_reefd_unreachable_the_agent_starts_on_the_installed_harness(box: Box) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    ok(box.install("claude", R1, url=f"http://127.0.0.1:{port}"))  # nothing listens there
    proc = ok(box.wrapper("-p", "hi"))
    assert proc.stdout == "STUB STARTED\n" and proc.stderr == ""
    update = box.wrapper("update")
    assert update.returncode != 0 and f"could not reach reefd at http://127.0.0.1:{port}" in update.stderr
    with socket.socket() as silent:  # accepts connections and never answers: the wrapper's short timeout ends it
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ok(box.install("claude", R1, url=f"http://127.0.0.1:{silent.getsockname()[1]}"))
        proc = box.wrapper("-p", "hi")
    assert ok(proc).stdout == "STUB STARTED\n" and proc.stderr == ""


def test_a_refused_token_is_said_and_the_agent_still_starts(box: Box, reef: FakeReef) -> None:
    ok(box.install("claude", R1, url=reef.url))
    proc = ok(box.wrapper(REEF_TOKEN="wrong"))
    assert proc.stderr == "reef-hello: reefd refused REEF_TOKEN (HTTP 401)\n" and proc.stdout == "STUB STARTED\n"
    report = box.wrapper("report", "--score", "1", REEF_TOKEN="wrong")
    assert report.returncode != 0 and "reefd answered HTTP 401: bad token" in report.stderr


def test_agent_binary_can_be_overridden(box: Box) -> None:
    ok(box.install("codex", R1))
    ok(box.wrapper("--", "update", REEF_AGENT_BIN=str(box.bin / "tool")))
    argv = box.stub()["argv"]
    assert Path(argv[0]).name == "tool" and argv[-1] == "update"


def test_codex_home_is_honoured(box: Box) -> None:
    env_home = box.root / "codex-home"
    script = box.root / "install.sh"
    script.write_text(installer("codex", SCENARIO, "http://127.0.0.1:9", R1))
    ok(subprocess.run(["sh", str(script)], env={**box.env, "CODEX_HOME": str(env_home)}, capture_output=True,
                      text=True, check=False))
    assert (env_home / "AGENTS.md").read_text() == block("r1-aaaaaaa", V1_TEXT)
    ok(box.wrapper("uninstall"))  # the manifest knows where the block went, whatever CODEX_HOME says now
    assert not (env_home / "AGENTS.md").exists()


# --- what must never be clobbered ---------------------------------------------------------------------------


def test_contents_install_byte_for_byte_and_nothing_in_them_runs(box: Box) -> None:
    nasty = {"rules/a.md": "EOF\nREEF_EOF\n$(touch pwned1)\n`touch pwned2`\n\\\ncrlf\r\n  trailing  \n",
             "rules/b.md": "<!-- reef:hello end -->\nno final newline ünïcödé",
             "rules/empty.md": "", "skills/x/SKILL.md": "'\"\n\n\n", "skills/x/scripts/run.sh": "#!/bin/sh\n"}
    ok(box.install("claude", harness("r1-aaaaaaa", nasty)))
    kept = box.data("claude") / "releases/r1-aaaaaaa/harness"
    assert {str(p.relative_to(kept)): p.read_bytes().decode() for p in kept.rglob("*") if p.is_file()} == nasty
    assert box.read(".claude/skills/x/scripts/run.sh") == "#!/bin/sh\n"
    assert (box.home / ".claude/CLAUDE.md").read_bytes().decode() == block(
        "r1-aaaaaaa", nasty["rules/a.md"] + "\n <!-- reef:hello end -->\nno final newline ünïcödé\n")
    assert not list(box.root.rglob("pwned*"))
    ok(box.wrapper("uninstall"))
    assert box.tree() == {}


def test_a_changed_skill_of_reefs_is_neither_overwritten_nor_deleted(box: Box) -> None:
    ok(box.install("claude", R1))
    changed = box.home / ".claude/skills/deploy/SKILL.md"
    changed.write_text("my tweaks\n")
    before = box.tree()
    proc = box.install("claude", harness("r2-bbbbbbb", {**HARNESS_V1, "skills/deploy/SKILL.md": "new\n"}))
    assert proc.returncode != 0 and f"{changed} was changed after Reef installed it" in proc.stderr
    assert box.tree() == before
    proc = ok(box.install("claude", R2))  # R2 drops the skill: the changed file stays, now the user's
    assert changed.read_text() == "my tweaks\n" and "kept" in proc.stderr
    ok(box.wrapper("uninstall"))
    assert box.tree() == {".claude": "dir", ".claude/skills": "dir", ".claude/skills/deploy": "dir",
                          ".claude/skills/deploy/SKILL.md": (0o644, b"my tweaks\n")}


def test_scenarios_and_adapters_side_by_side(box: Box) -> None:
    seed_user_files(box, "claude")
    (box.home / ".claude/CLAUDE.md").unlink()
    (box.home / "dotfiles").mkdir()
    (box.home / "dotfiles/CLAUDE.md").write_text(USER_NOTES)
    (box.home / ".claude/CLAUDE.md").symlink_to(box.home / "dotfiles/CLAUDE.md")  # a user's symlink stays one
    before = box.tree()
    ok(box.install("claude", R1))
    other = harness("r7-ccccccc", {"rules/o.md": "Other rule.\n", "skills/other-skill/SKILL.md": SKILL})
    ok(subprocess.run(["sh"], input=installer("claude", "other", "http://127.0.0.1:9", other), env=box.env,
                      capture_output=True, text=True, check=False))
    ok(box.install("codex", R1))  # the wrapper now starts codex; both adapters' files are there
    assert (box.home / ".claude/CLAUDE.md").is_symlink()
    other_block = "<!-- reef:other begin release=r7-ccccccc -->\nOther rule.\n<!-- reef:other end -->\n"
    assert box.read("dotfiles/CLAUDE.md") == USER_NOTES + block("r1-aaaaaaa", V1_TEXT) + other_block
    assert box.read(".codex/AGENTS.md") == block("r1-aaaaaaa", V1_TEXT)
    ok(box.wrapper("uninstall"))  # every adapter of scenario hello; scenario other stays
    assert box.read("dotfiles/CLAUDE.md") == USER_NOTES + other_block
    assert not (box.home / ".codex").exists() and not (box.home / ".claude/skills/deploy").exists()
    (box.root / "other-wrapper").write_bytes((box.home / ".local/bin/reef-other").read_bytes())
    ok(subprocess.run(["sh", str(box.root / "other-wrapper"), "uninstall"], env=box.env, capture_output=True,
                      text=True, check=False))
    assert box.tree() == before


def test_a_harness_newer_than_reefds_current_is_left_alone(box: Box, reef: FakeReef) -> None:
    reef.chain = [R1, R2]
    ok(box.install("claude", R2, url=reef.url))
    reef.current = R1["release"]  # reefd serves an older release (pinned): that is no update
    assert ok(box.wrapper()).stderr == ""


def test_the_wrapper_needs_the_token(box: Box) -> None:
    ok(box.install("claude", R1))
    env = {k: v for k, v in box.env.items() if k != "REEF_TOKEN"}
    proc = subprocess.run([str(box.home / ".local/bin/reef-hello")], env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode != 0 and "set REEF_TOKEN" in proc.stderr
