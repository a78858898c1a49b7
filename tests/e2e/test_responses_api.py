"""The OpenAI Responses surface, driven by the official `openai` SDK against real reefd.

The tiny model never writes tool calls, so the tool-call event stream is checked in-process on
the wire itself, against the SDK's own event models.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from reefd.api.errors import ApiError
from reefd.api.responses import ResponsesWire, input_messages
from reefd.serve.chat import ChatRequest, Completion
from tests.conftest import Daemon, base_release, sdk

HEADERS = {"x-reef-scenario": "tiny"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": False}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def client(d: Daemon) -> openai.OpenAI:
    return sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                             default_headers=HEADERS))


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    status, body = d.get(f"/reef/records/{receipt}")
    assert status == 200, body
    return dict(json.loads(body))


def create(d: Daemon, **kw: Any) -> tuple[Response, dict[str, Any]]:
    raw = client(d).responses.with_raw_response.create(model="tiny", max_output_tokens=4, **kw)
    return raw.parse(), record(d, raw.headers["x-reef-agent-record-id"])


def test_non_streaming_response_carries_receipt_and_durable_record(daemon: Daemon) -> None:
    raw = client(daemon).responses.with_raw_response.create(
        model="gpt-5-codex", input="Say hi", max_output_tokens=5, temperature=0.5)
    receipt = raw.headers["x-reef-agent-record-id"]
    assert raw.headers["x-reef-release-id"] == base_release(daemon)
    resp = raw.parse()
    assert resp.id == "resp_" + receipt and resp.object == "response"
    assert resp.model == "tiny"  # the scenario answers, whatever model the agent names
    assert resp.status in ("completed", "incomplete") and resp.error is None
    assert (resp.incomplete_details is not None) == (resp.status == "incomplete")
    assert resp.temperature == 0.5 and resp.max_output_tokens == 5
    rec = record(daemon, receipt)
    assert rec["api"] == "openai.responses" and rec["scenario"] == "tiny"
    assert rec["requested_model"] == "gpt-5-codex"
    assert rec["response"]["store"] is True  # OpenAI's default
    assert rec["messages"][0] == {"role": "user", "content": "Say hi"}
    assert resp.output_text == (rec["messages"][-1]["content"] or "")
    assert resp.usage is not None
    assert resp.usage.output_tokens == len(rec["completion_token_ids"]) <= 5
    assert resp.usage.input_tokens == len(rec["prompt_token_ids"])
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert rec["response"] == resp.model_dump(mode="json", exclude_unset=True)


def _expected_types(deltas: int, final: str) -> list[str]:
    text = (["response.output_item.added", "response.content_part.added"]
            + ["response.output_text.delta"] * deltas
            + ["response.output_text.done", "response.content_part.done",
               "response.output_item.done"]) if deltas else []
    return ["response.created", "response.in_progress", *text, f"response.{final}"]


def test_streaming_events_in_order_terminal_after_durable(daemon: Daemon) -> None:
    with client(daemon).responses.with_streaming_response.create(
            model="tiny", input=[{"role": "user", "content": "stream please"}],
            max_output_tokens=8, stream=True) as raw:
        receipt = raw.headers["x-reef-agent-record-id"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        events: list[Any] = list(raw.parse())
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert types == _expected_types(deltas, final.type.removeprefix("response."))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.response.output_text == text and final.response.id == "resp_" + receipt
    assert final.response.usage is not None and final.response.usage.output_tokens >= 1
    rec = record(daemon, receipt)  # readable as soon as the terminal event was seen
    assert rec["stream"] is True
    assert rec["response"] == final.response.model_dump(mode="json", exclude_unset=True)


def test_instructions_and_developer_messages_become_system(daemon: Daemon) -> None:
    _, rec = create(daemon, instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert rec["messages"][:3] == [{"role": "system", "content": "Be brief."},
                                   {"role": "system", "content": "Answer in French."},
                                   {"role": "user", "content": "Hi"}]
    assert rec["response"]["instructions"] == "Be brief."


def test_function_call_round_trip_is_recorded_as_chat_tool_messages(daemon: Daemon) -> None:
    first, rec1 = create(daemon, input="Weather in Paris?", tools=[WEATHER],
                         tool_choice={"type": "function", "name": "get_weather"})
    assert rec1["tools"] == [{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}]
    assert [t.name for t in first.tools] == ["get_weather"]  # type: ignore[union-attr]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": "{\"city\": \"Paris\"}"}
    _, rec2 = create(daemon, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        call, {**call, "call_id": "call_2", "arguments": "{\"city\": \"Lyon\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}])
    assistant, tool1, tool2 = rec2["messages"][1:4]
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert [(c["id"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        ("call_1", "get_weather"), ("call_2", "get_weather")]
    assert tool1 == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert tool2 == {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
    assert rec2["messages"][-1]["role"] == "assistant" and len(rec2["messages"]) == 5


def test_hosted_tool_types_are_ignored(daemon: Daemon) -> None:
    tools = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
             {"type": "namespace", "name": "shell", "description": "x", "tools": []}, WEATHER]
    resp, rec = create(daemon, input="search", tools=tools,
                       tool_choice={"type": "web_search"}, parallel_tool_calls=False,
                       reasoning={"effort": "low"}, include=["reasoning.encrypted_content"],
                       prompt_cache_key="k", text={"format": {"type": "text"}}, truncation="auto",
                       metadata={"a": "b"}, user="u", service_tier="auto")
    assert [t["function"]["name"] for t in rec["tools"]] == ["get_weather"]
    assert len(resp.tools) == 4 and resp.parallel_tool_calls is False


@pytest.mark.parametrize("kw,param", [
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0"),
])
def test_bad_requests_are_400_naming_the_field(daemon: Daemon, kw: dict[str, Any],
                                                param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(daemon).responses.create(model="tiny", **kw)
    body = exc.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert body["type"] == "invalid_request_error"


def test_stored_response_is_retrievable_and_continues(daemon: Daemon) -> None:
    first, rec1 = create(daemon, input="first question", instructions="Old rules.")
    c = client(daemon)
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    second, rec2 = create(daemon, input="second question", instructions="New rules.",
                          previous_response_id=first.id, store=True)
    assert second.previous_response_id == first.id
    # instructions are not carried over (as on OpenAI); the rest of the conversation is
    assert rec2["messages"][0] == {"role": "system", "content": "New rules."}
    assert rec2["messages"][1:len(rec1["messages"])] == rec1["messages"][1:]
    assert rec2["messages"][-2] == {"role": "user", "content": "second question"}
    _, rec3 = create(daemon, input="third", previous_response_id=second.id)
    assert rec3["messages"][:len(rec2["messages"]) - 1] == rec2["messages"][1:]


def test_unstored_and_unknown_responses_are_not_found(daemon: Daemon) -> None:
    c = client(daemon)
    unstored, _ = create(daemon, input="private", store=False)
    chat = c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    chat_id = "resp_" + chat.headers["x-reef-agent-record-id"]
    for rid in (unstored.id, chat_id, "resp_01ARZ3NDEKTSV4RRFFQ69G5FAV", "nope"):
        with pytest.raises(openai.NotFoundError) as exc:
            c.responses.retrieve(rid)
        body = exc.value.body
        assert isinstance(body, dict) and rid in body["message"], body
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model="tiny", input="x", previous_response_id=unstored.id)
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["code"] == "previous_response_not_found"
    assert bad.value.body["param"] == "previous_response_id"


def _get(d: Daemon, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any], str]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {d.token}", **HEADERS,
                                           **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), resp.getheader("Connection", "")
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v1/responses", "/scenarios/tiny/v1/responses"])
def test_websocket_upgrade_is_refused_so_clients_fall_back(daemon: Daemon, path: str) -> None:
    status, body, connection = _get(daemon, path, {
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert status == 426 and connection.lower() == "close"
    assert body["error"]["type"] == "invalid_request_error" and "POST" in body["error"]["message"]
    status, body, _ = _get(daemon, path, {})
    assert status == 405 and set(body["error"]) == {"message", "type", "param", "code"}


def test_report_on_a_responses_receipt(daemon: Daemon) -> None:
    raw = client(daemon).responses.with_raw_response.create(model="tiny", input="x",
                                                            max_output_tokens=2)
    receipt = raw.headers["x-reef-agent-record-id"]
    status, body, _ = daemon.post("/reef/report", {"score": 1, "feedback": "good",
                                                   "references": [receipt]})
    assert status == 200, body
    assert record(daemon, receipt)["reports"][0]["feedback"] == "good"


# ------------------------------------------------------------------ the wire, in-process

CALLS = [{"id": "call_a", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
         {"id": "call_b", "type": "function",
          "function": {"name": "get_time", "arguments": "{}"}}]


def _wire() -> ResponsesWire:
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=16,
                       temperature=0.7, top_p=1.0)
    return ResponsesWire("01ARZ3NDEKTSV4RRFFQ69G5FAV", "tiny",
                         {"model": "gpt-5", "input": "x", "tools": [WEATHER]}, chat)


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            head, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == "event: " + event["type"]
            EVENTS.validate_python(event)  # the SDK's own models, strictly
            out.append(event)
    return out


def test_wire_streams_text_then_tool_calls_with_sdk_valid_events() -> None:
    wire = _wire()
    done = Completion(text="Let me check.", finish_reason="tool_calls", prompt_tokens=3,
                      completion_tokens=9, tool_calls=CALLS)
    events = _events(wire.stream_head(3) + wire.stream_delta("Let me ")
                     + wire.stream_delta("check.") + wire.stream_tail(done)
                     + wire.stream_terminal())
    calls = ["response.output_item.added", "response.function_call_arguments.delta",
             "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [*_expected_types(2, "completed")[:-1], *calls, *calls,
                                           "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"), (1, "function_call"), (2, "function_call")]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["item_id"], e["arguments"]) for e in args] == [
        ("fc_a", "{\"city\": \"Paris\"}"), ("fc_b", "{}")]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Let me check." and final.status == "completed"
    assert [(o.call_id, o.name) for o in final.output[1:]] == [  # type: ignore[union-attr]
        ("call_a", "get_weather"), ("call_b", "get_time")]
    assert events[-1]["response"] == wire.response(done)


def test_wire_emits_unstreamed_text_in_the_tail_and_marks_length_incomplete() -> None:
    wire = _wire()
    cut = Completion(text="abc", finish_reason="length", prompt_tokens=3, completion_tokens=16)
    events = _events(wire.stream_head(3) + wire.stream_tail(cut) + wire.stream_terminal())
    assert [e["type"] for e in events] == _expected_types(1, "incomplete")
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.output_text == "abc"
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    only_calls = _wire()
    bare = Completion(text=None, finish_reason="tool_calls", prompt_tokens=3, completion_tokens=4,
                      tool_calls=CALLS[:1])
    events = _events(only_calls.stream_head(3) + only_calls.stream_tail(bare))
    assert [(e["type"], e.get("output_index")) for e in events[2:3]] == [
        ("response.output_item.added", 0)]
    Response.model_validate(only_calls.response(bare))


def test_wire_error_is_an_error_event_then_response_failed() -> None:
    wire = _wire()
    events = _events(wire.stream_head(3) + wire.stream_delta("x")
                     + wire.stream_error(ApiError(502, "engine died", code="engine_error")))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_error" and events[-2]["message"] == "engine died"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "engine died"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_input_items_convert_to_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages = input_messages([
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": []}])
    assert messages[0]["content"] == "Checking."
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["c1", "c2"]
    assert messages[1:] == [{"role": "tool", "tool_call_id": "c1", "content": "1"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
