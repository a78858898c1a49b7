"""The Anthropic Messages surface, driven by the official `anthropic` SDK against real reefd."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.conftest import Daemon, base_release, sdk


def client(d: Daemon, **headers: str) -> anthropic.Anthropic:
    return sdk(anthropic.Anthropic(base_url=d.url, api_key=d.token, max_retries=0,
                               default_headers={"x-reef-scenario": "tiny", **headers}))


def record(d: Daemon, receipt: str) -> dict:
    status, body = d.get(f"/reef/records/{receipt}")
    assert status == 200, body
    return json.loads(body)


def test_non_streaming_message_with_system_blocks(daemon: Daemon) -> None:
    raw = client(daemon).messages.with_raw_response.create(
        model="tiny", max_tokens=5, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}])
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= msg.usage.output_tokens <= 5
    rec = record(daemon, raw.headers["x-reef-agent-record-id"])
    assert raw.headers["x-reef-release-id"] == base_release(daemon)
    assert rec["api"] == "anthropic.messages"
    assert rec["messages"][0] == {"role": "system", "content": "Be brief."}
    assert rec["usage"]["completion_tokens"] == msg.usage.output_tokens
    assert len(rec["completion_logprobs"]) == msg.usage.output_tokens


def test_streaming_event_order_and_durable_before_message_stop(daemon: Daemon) -> None:
    with client(daemon).messages.with_streaming_response.create(
            model="tiny", max_tokens=6, stream=True, system="You are terse.",
            messages=[{"role": "user", "content": "stream"}]) as resp:
        receipt = resp.headers["x-reef-agent-record-id"]
        events = [line[len("event: "):] for line in resp.iter_lines()
                  if line.startswith("event: ")]
    kinds = [e for e in events if e != "ping"]
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    if "content_block_start" in kinds:
        i = kinds.index("content_block_start")
        assert kinds[i + 1] == "content_block_delta" and "content_block_stop" in kinds
    assert record(daemon, receipt)["stream"] is True


def test_sdk_stream_helper_assembles_the_same_text(daemon: Daemon) -> None:
    c = client(daemon)
    with c.messages.stream(model="tiny", max_tokens=8, extra_body={"temperature": 0},
                           messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = c.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0},
                              messages=[{"role": "user", "content": "hello"}])
    assert text == "".join(b.text for b in final.content if b.type == "text")
    assert text == "".join(b.text for b in plain.content if b.type == "text")


def test_tool_use_and_tool_result_blocks_are_accepted(daemon: Daemon) -> None:
    raw = client(daemon).messages.with_raw_response.create(
        model="tiny", max_tokens=4,
        tools=[{"name": "ls", "description": "list files",
                "input_schema": {"type": "object", "properties": {"dir": {"type": "string"}}}}],
        messages=[
            {"role": "user", "content": "list /tmp"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"dir": "/tmp"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                {"type": "text", "text": "thanks"}]},
        ], stop_sequences=["\n\n"])
    rec = record(daemon, raw.headers["x-reef-agent-record-id"])
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]
    assert rec["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"dir": "/tmp"}'
    assert rec["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"}
    assert rec["tools"][0]["function"]["name"] == "ls"


def test_count_tokens_matches_the_prompt_the_engine_saw(daemon: Daemon) -> None:
    c = client(daemon)
    messages = [{"role": "user", "content": "how many tokens is this?"}]
    counted = c.messages.count_tokens(model="tiny", messages=messages)  # type: ignore[arg-type]
    raw = c.messages.with_raw_response.create(model="tiny", max_tokens=1,
                                              messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == raw.parse().usage.input_tokens > 0


def test_max_tokens_is_required(daemon: Daemon) -> None:
    # the SDK itself refuses to send this, so post the raw body
    status, body, _ = daemon.post("/v1/messages", {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"anthropic-version": "2023-06-01"})
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_errors_use_the_anthropic_shape(daemon: Daemon) -> None:
    bad = sdk(anthropic.Anthropic(base_url=daemon.url, api_key="wrong", max_retries=0,
                              default_headers={"x-reef-scenario": "tiny"}))
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert isinstance(exc.value.body, dict)
    assert exc.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as nf:
        client(daemon, **{"x-reef-scenario": "ghost"}).messages.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert isinstance(nf.value.body, dict) and nf.value.body["error"]["type"] == "not_found_error"


def test_path_form_and_anthropic_shaped_errors_on_it(daemon: Daemon) -> None:
    c = sdk(anthropic.Anthropic(base_url=daemon.url + "/scenarios/tiny", api_key=daemon.token,
                                max_retries=0))
    raw = c.messages.with_raw_response.create(model="tiny", max_tokens=2,
                                              messages=[{"role": "user", "content": "by path"}])
    assert record(daemon, raw.headers["x-reef-agent-record-id"])["api"] == "anthropic.messages"
    ghost = sdk(anthropic.Anthropic(base_url=daemon.url + "/scenarios/ghost", api_key=daemon.token,
                                    max_retries=0))
    with pytest.raises(anthropic.NotFoundError) as exc:
        ghost.messages.create(model="x", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert isinstance(exc.value.body, dict) and exc.value.body["type"] == "error"


def test_claude_code_shaped_fields_are_accepted(daemon: Daemon) -> None:
    c = client(daemon)
    raw = c.messages.with_raw_response.create(
        model="claude-agent-model-x", max_tokens=3,
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be careful."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                 "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "Mid-conversation reminder."},  # type: ignore[list-item]
                  {"role": "user", "content": "go on"}],
        metadata={"user_id": '{"device_id": "d1", "session_id": "s-42"}'},
        extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                    "output_config": {"effort": "low"}},
        extra_query={"beta": "true"},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    msg = raw.parse()
    assert msg.model == "tiny"  # served under the scenario's own name
    rec = record(daemon, raw.headers["x-reef-agent-record-id"])
    assert rec["requested_model"] == "claude-agent-model-x"
    assert rec["messages"][0] == {
        "role": "system",
        "content": "You are Claude Code.\n\nBe careful.\n\nMid-conversation reminder."}
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "user", "assistant"]
    assert rec["session"] == '{"device_id": "d1", "session_id": "s-42"}'


def test_agent_session_headers_become_the_session(daemon: Daemon) -> None:
    c = client(daemon)
    for header in ("X-Claude-Code-Session-Id", "session-id", "x-session-id"):
        raw = c.messages.with_raw_response.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": "s"}],
            extra_headers={header: f"sess-{header}"})
        assert record(daemon, raw.headers["x-reef-agent-record-id"])["session"] == f"sess-{header}"
    raw = c.messages.with_raw_response.create(
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": "s"}],
        extra_headers={"x-reef-session": "mine", "x-session-id": "theirs"})
    assert record(daemon, raw.headers["x-reef-agent-record-id"])["session"] == "mine"


def test_head_probe_on_the_root_answers(daemon: Daemon) -> None:
    import urllib.request

    req = urllib.request.Request(daemon.url + "/", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
