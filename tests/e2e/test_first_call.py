"""The scenario header on a session's first call only, through the real daemon and the official SDKs: a later call
that names no scenario goes to the scenario of the session it continues (its session header, a transcript that
extends a served turn, or for Responses its previous_response_id), in all three APIs; a call that continues
nothing known still gets the clear 400. The shared daemon serves `tiny` and a scenario of the test's own, so a
call that found no session cannot land on the right scenario by chance."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Daemon, sdk

SCENARIO = "defaults:\n  - model: tiny\n  - _self_\nserve:\n  default_max_tokens: 4\n"


@pytest.fixture
def named(daemon: Daemon, own_scenario: Callable[..., str]) -> str:
    return own_scenario(daemon, SCENARIO, prefix="first")


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    code, body = d.get(f"/reef/records/{receipt}")
    assert code == 200, body
    return dict(json.loads(body))


def chat(d: Daemon) -> openai.OpenAI:
    return sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0))


def messages_api(d: Daemon) -> anthropic.Anthropic:
    return sdk(anthropic.Anthropic(base_url=d.url, api_key=d.token, max_retries=0))


def test_chat_completions_find_the_session_by_its_header_and_by_its_transcript(daemon: Daemon, named: str) -> None:
    c, session = chat(daemon), f"sess-{uuid.uuid4().hex}"
    ask = [{"role": "user", "content": "hello"}]
    first = c.chat.completions.with_raw_response.create(
        model=named, max_tokens=4, messages=ask, extra_headers={"x-reef-scenario": named, "x-reef-session": session})
    later = c.chat.completions.with_raw_response.create(model=named, max_tokens=4, extra_headers={
        "x-reef-session": session}, messages=[{"role": "user", "content": "and then?"}])
    rec = record(daemon, later.headers["x-reef-agent-record-id"])
    assert (rec["scenario"], rec["session"], rec["turn"]) == (named, session, 1)

    plain = c.chat.completions.with_raw_response.create(model=named, max_tokens=4, messages=ask,
                                                        extra_headers={"x-reef-scenario": named})
    reply = plain.parse().choices[0].message.content or ""
    more = [*ask, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    follow = c.chat.completions.with_raw_response.create(model=named, max_tokens=4, messages=more)
    rec = record(daemon, follow.headers["x-reef-agent-record-id"])
    assert rec["scenario"] == named and rec["previous"] == plain.headers["x-reef-agent-record-id"]
    assert first.headers["x-reef-agent-record-id"] != rec["id"]


def test_messages_find_the_session_by_claude_codes_header_and_by_its_transcript(daemon: Daemon, named: str) -> None:
    c, session = messages_api(daemon), str(uuid.uuid4())
    ask = [{"role": "user", "content": "hello"}]
    c.messages.with_raw_response.create(model=named, max_tokens=4, messages=ask,  # type: ignore[arg-type]
                                        extra_headers={"x-reef-scenario": named, "x-claude-code-session-id": session})
    later = c.messages.with_raw_response.create(model=named, max_tokens=4,  # type: ignore[arg-type]
                                                messages=[{"role": "user", "content": "and then?"}],
                                                extra_headers={"x-claude-code-session-id": session})
    rec = record(daemon, later.headers["x-reef-agent-record-id"])
    assert (rec["scenario"], rec["session"], rec["turn"]) == (named, session, 1)

    plain = c.messages.with_raw_response.create(model=named, max_tokens=4, messages=ask,  # type: ignore[arg-type]
                                                extra_headers={"x-reef-scenario": named})
    reply = "".join(b.text for b in plain.parse().content if b.type == "text")
    more = [*ask, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    follow = c.messages.with_raw_response.create(model=named, max_tokens=4, messages=more)  # type: ignore[arg-type]
    rec = record(daemon, follow.headers["x-reef-agent-record-id"])
    assert rec["scenario"] == named and rec["previous"] == plain.headers["x-reef-agent-record-id"]


def test_responses_find_the_session_by_previous_response_and_by_transcript(daemon: Daemon, named: str) -> None:
    c = chat(daemon)
    first = c.responses.with_raw_response.create(model=named, input="hello", max_output_tokens=4, store=True,
                                                 extra_headers={"x-reef-scenario": named})
    later = c.responses.with_raw_response.create(model=named, input="and then?", max_output_tokens=4,
                                                 previous_response_id=first.parse().id)
    rec = record(daemon, later.headers["x-reef-agent-record-id"])
    assert rec["scenario"] == named and rec["previous"] == first.headers["x-reef-agent-record-id"]

    reply = first.parse().output_text
    items: Any = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "and then?"}]
    follow = c.responses.with_raw_response.create(model=named, input=items, max_output_tokens=4)
    rec = record(daemon, follow.headers["x-reef-agent-record-id"])
    assert rec["scenario"] == named and rec["previous"] == first.headers["x-reef-agent-record-id"]


def test_a_call_that_continues_no_known_session_gets_the_clear_400(daemon: Daemon, named: str) -> None:
    stranger = {"x-reef-session": f"never-seen-{uuid.uuid4().hex}"}
    with pytest.raises(openai.BadRequestError) as chat_error:
        chat(daemon).chat.completions.create(model=named, max_tokens=4, extra_headers=stranger,
                                             messages=[{"role": "user", "content": "hello"}])
    assert chat_error.value.body["code"] == "scenario_missing"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        messages_api(daemon).messages.create(model=named, max_tokens=4,
                                             messages=[{"role": "user", "content": f"new {uuid.uuid4().hex}"}])
    assert "x-reef-scenario" in str(messages_error.value)
    with pytest.raises(openai.BadRequestError) as responses_error:
        chat(daemon).responses.create(model=named, input=f"new {uuid.uuid4().hex}", max_output_tokens=4)
    assert responses_error.value.body["code"] == "scenario_missing"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # a previous response nobody served: still the 400
        chat(daemon).responses.create(model=named, input="x", max_output_tokens=4,
                                      previous_response_id=f"resp_{uuid.uuid4().hex}")


def test_a_report_without_the_header_goes_to_the_scenario_of_the_record_it_references(daemon: Daemon,
                                                                                        named: str) -> None:
    raw = chat(daemon).chat.completions.with_raw_response.create(
        model=named, max_tokens=4, messages=[{"role": "user", "content": "hello"}],
        extra_headers={"x-reef-scenario": named})
    receipt = raw.headers["x-reef-agent-record-id"]
    code, body, _ = daemon.post("/reef/report", {"score": 1, "references": [receipt]}, headers={"x-reef-scenario": ""})
    assert code == 200 and body["scenario"] == named, body
    code, body, _ = daemon.post("/reef/report", {"score": 1, "references": ["01JABCDEFGHJKMNPQRSTVWXYZ0"]},
                                headers={"x-reef-scenario": ""})
    assert code == 400 and body["error"]["code"] == "scenario_missing", body
