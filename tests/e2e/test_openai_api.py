"""The OpenAI Chat Completions surface, driven by the official `openai` SDK against real reefd."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import Daemon, base_release, sdk

HEADERS = {"x-reef-scenario": "tiny"}


def client(d: Daemon, **kw: object) -> openai.OpenAI:
    return sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                         default_headers=HEADERS, **kw))  # type: ignore[arg-type]


def record(d: Daemon, receipt: str) -> dict:
    status, body = d.get(f"/reef/records/{receipt}")
    assert status == 200, body
    return json.loads(body)


def test_non_streaming_answer_carries_receipt_and_durable_record(daemon: Daemon) -> None:
    raw = client(daemon).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, seed=3,
        extra_headers={"x-reef-session": "sess-1", "x-reef-tag-Team": "blue"})
    receipt = raw.headers["x-reef-agent-record-id"]
    assert raw.headers["x-reef-release-id"] == base_release(daemon)
    answer = raw.parse()
    assert answer.object == "chat.completion"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 5
    rec = record(daemon, receipt)
    assert rec["scenario"] == "tiny" and rec["api"] == "openai.chat_completions"
    assert rec["request"]["messages"][0]["content"] == "Say hi"
    assert rec["response"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
    assert len(rec["completion_token_ids"]) == answer.usage.completion_tokens
    assert len(rec["completion_logprobs"]) == len(rec["completion_token_ids"])
    assert all(lp <= 0 for lp in rec["completion_logprobs"])
    assert len(rec["prompt_token_ids"]) == answer.usage.prompt_tokens
    assert rec["messages"][-1]["role"] == "assistant"
    assert rec["session"] == "sess-1" and rec["tags"] == {"team": "blue"}
    assert rec["latency_s"] > 0 and rec["created_at"] <= rec["finished_at"]


def test_seed_and_max_completion_tokens_are_honoured(daemon: Daemon) -> None:
    c = client(daemon)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "count"}], seed=11,
              temperature=1.0, top_p=0.9)
    a = c.chat.completions.create(max_completion_tokens=6, **kw)  # type: ignore[call-overload]
    b = c.chat.completions.create(max_completion_tokens=6, **kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 6
    short = c.chat.completions.create(max_tokens=2, **kw)  # type: ignore[call-overload]
    assert short.usage.completion_tokens <= 2


def test_streaming_role_first_usage_last_done_after_durable(daemon: Daemon) -> None:
    c = client(daemon)
    with c.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "stream please"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True}) as resp:
        receipt = resp.headers["x-reef-agent-record-id"]
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {ch["id"] for ch in chunks} == {chunks[0]["id"]}
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all(ch["usage"] is None for ch in chunks[:-1])
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1]
                   if ch["choices"])
    rec = record(daemon, receipt)  # readable as soon as [DONE] was seen
    assert rec["response"]["choices"][0]["message"]["content"] == text
    assert rec["stream"] is True


def test_stream_without_include_usage_has_no_usage_chunk(daemon: Daemon) -> None:
    stream = client(daemon).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.usage is None for ch in chunks)


def test_stop_sequence_cuts_the_text(daemon: Daemon) -> None:
    c = client(daemon)
    base = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}],
                                     max_tokens=12, temperature=0)
    text = base.choices[0].message.content or ""
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}],
                                    max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_tools_and_tool_messages_render_and_are_recorded(daemon: Daemon) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    raw = client(daemon).chat.completions.with_raw_response.create(
        model="tiny", messages=messages, tools=tools, tool_choice="auto", max_tokens=4)
    rec = record(daemon, raw.headers["x-reef-agent-record-id"])
    assert rec["tools"] == tools
    assert rec["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    # the prompt the engine saw holds the rendered tools and the tool result
    assert len(rec["prompt_token_ids"]) > 60


def test_models_lists_scenarios(daemon: Daemon) -> None:
    models = client(daemon).models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.parametrize("headers,status,fragment", [
    ({}, 400, "x-reef-scenario"),
    ({"x-reef-scenario": "nope"}, 404, "known scenarios: tiny"),
])
def test_scenario_header_errors(daemon: Daemon, headers: dict, status: int,
                                fragment: str) -> None:
    c = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
                      default_headers=headers))
    with pytest.raises(openai.APIStatusError) as exc:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == status
    body = exc.value.body
    assert isinstance(body, dict) and fragment in body["message"]
    assert set(body) >= {"message", "type", "param", "code"}


def test_bad_token_is_401_in_openai_shape(daemon: Daemon) -> None:
    c = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key="wrong", max_retries=0,
                      default_headers=HEADERS))
    with pytest.raises(openai.AuthenticationError) as exc:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 401


def test_wrong_types_name_the_field(daemon: Daemon) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(daemon).chat.completions.create(
            model="tiny", messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc,list-item]
    body = exc.value.body
    assert isinstance(body, dict)
    assert body["param"] == "messages.0.role" and body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as exc:
        client(daemon).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens="many")  # type: ignore[arg-type]
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "max_tokens"


def test_path_form_names_the_scenario_without_a_header(daemon: Daemon) -> None:
    c = sdk(openai.OpenAI(base_url=daemon.url + "/scenarios/tiny/v1", api_key=daemon.token,
                          max_retries=0))
    raw = c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "by path"}], max_tokens=2)
    assert record(daemon, raw.headers["x-reef-agent-record-id"])["scenario"] == "tiny"
    ghost = sdk(openai.OpenAI(base_url=daemon.url + "/scenarios/ghost/v1", api_key=daemon.token,
                              max_retries=0))
    with pytest.raises(openai.NotFoundError):
        ghost.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}])


def test_logprobs_in_answers_are_refused_clearly(daemon: Daemon) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(daemon).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "logprobs"
    ok = client(daemon).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=False, max_tokens=1)
    assert ok.choices[0].logprobs is None
