"""Real agents' requests, replayed byte for byte against reefd.

The fixture is Claude Code 2.1.332's first turn, recorded on loopback (tests/fixtures/README.md).
The daemon's "hello" scenario runs the tiny model with a generation cap, as an operator would
serve a coding agent.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ROOT, Daemon, make_scenarios

FIXTURE = json.loads((ROOT / "tests/fixtures/claude_code_2.1.332_first_turn.json").read_text())
HELLO = "defaults:\n  - model: tiny\n  - _self_\nmodel:\n  max_new_tokens: 16\n"


@pytest.fixture(scope="module")
def agentd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("agents")
    d = Daemon(scenarios=make_scenarios(base / "s", names=(), extra={"hello": HELLO}),
               state=base / "state", log_path=base / "reefd.log")
    d.start()
    yield d
    d.stop()


def send(d: Daemon, fixture: dict[str, Any], body: dict[str, Any] | None = None
         ) -> tuple[str, list[bytes]]:
    """Send a recorded request as the agent did; return the receipt and the SSE lines."""
    headers = {**fixture["headers"], "Authorization": f"Bearer {d.token}"}
    req = urllib.request.Request(d.url + fixture["path"], method=fixture["method"],
                                 data=json.dumps(body or fixture["body"]).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.headers["x-reef-agent-record-id"], [line.strip() for line in r if line.strip()]


def replay(d: Daemon, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The Claude Code turn with `body`; returns the receipt and the SSE event names."""
    receipt, lines = send(d, FIXTURE, body)
    return receipt, [line.decode()[len("event: "):] for line in lines if line.startswith(b"event: ")]


def test_claude_code_first_turn_is_served_and_recorded(agentd: Daemon) -> None:
    receipt, events = replay(agentd, FIXTURE["body"])
    assert events[0] == "message_start" and events[-1] == "message_stop"
    rec = json.loads(agentd.get(f"/reef/records/{receipt}")[1])
    body = FIXTURE["body"]
    assert rec["requested_model"] == body["model"] and rec["model"] == "tiny"
    assert rec["session"] == FIXTURE["headers"]["X-Claude-Code-Session-Id"]
    assert rec["usage"]["completion_tokens"] <= 16  # the scenario's cap, not the asked 128000
    assert rec["messages"][0]["role"] == "system"
    system = rec["messages"][0]["content"]
    assert all(b["text"] in system for b in body["system"])  # top-level blocks, in order...
    in_messages = [m for m in body["messages"] if m["role"] == "system"]
    assert in_messages and all(b["text"] in system for m in in_messages for b in m["content"])
    assert len(rec["tools"]) == len(body["tools"])
    assert len(rec["prompt_token_ids"]) == rec["usage"]["prompt_tokens"] > 5000
    status, report, _ = agentd.post("/reef/report", {"score": 1, "references": [receipt]},
                                    headers={"x-reef-scenario": "hello"})
    assert status == 200 and report["references"] == [receipt]


def test_claude_code_tool_round_trip(agentd: Daemon) -> None:
    body = copy.deepcopy(FIXTURE["body"])
    tool = body["tools"][0]["name"]
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_01", "name": tool, "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "app.py",
             "cache_control": {"type": "ephemeral"}}]},
    ]
    receipt, events = replay(agentd, body)
    assert events[-1] == "message_stop"
    rec = json.loads(agentd.get(f"/reef/records/{receipt}")[1])
    roles = [m["role"] for m in rec["messages"]]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    assert rec["messages"][-3]["tool_calls"][0]["function"]["name"] == tool
    assert rec["messages"][-2] == {"role": "tool", "tool_call_id": "toolu_01", "content": "app.py"}


CODEX = json.loads((ROOT / "tests/fixtures/codex_0.171.0_first_turn.json").read_text())


def test_codex_first_turn_is_served_and_recorded(agentd: Daemon) -> None:
    receipt, lines = send(agentd, CODEX)
    events = [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")  # the cap may cut it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    rec = json.loads(agentd.get(f"/reef/records/{receipt}")[1])
    assert rec["api"] == "openai.responses" and rec["session"] == CODEX["headers"]["session_id"]
    functions = [t for t in CODEX["body"]["tools"] if t["type"] == "function"]
    assert 0 < len(rec["tools"]) == len(functions)  # the namespace entry is ignored, as documented
    assert rec["messages"][0]["role"] == "system"  # Codex's developer message
    status, report, _ = agentd.post("/reef/report", {"score": 0, "feedback": "gibberish",
                                                     "references": [receipt]},
                                    headers={"x-reef-scenario": "hello"})
    assert status == 200 and report["references"] == [receipt]


OPENCODE = json.loads((ROOT / "tests/fixtures/opencode_1.18.33_main_call.json").read_text())


def test_opencode_main_call_is_served_and_recorded(agentd: Daemon) -> None:
    receipt, lines = send(agentd, OPENCODE)
    lines = [line for line in lines if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    usage = json.loads(lines[-2][len(b"data: "):])["usage"]  # opencode asks for usage
    rec = json.loads(agentd.get(f"/reef/records/{receipt}")[1])
    assert rec["usage"]["completion_tokens"] == usage["completion_tokens"] <= 16
    assert rec["session"] == OPENCODE["headers"]["x-session-id"]
    assert len(rec["tools"]) == len(OPENCODE["body"]["tools"]) == 10
    status, report, _ = agentd.post("/reef/report", {"score": 0.5, "references": [receipt]},
                                    headers={"x-reef-scenario": "hello"})
    assert status == 200 and report["references"] == [receipt]
