"""Generation caps and context length, answered in each provider's own terms."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.conftest import Daemon, make_scenarios, sdk

CAPPED = "defaults:\n  - model: tiny\n  - _self_\nmodel:\n  max_new_tokens: 3\n"
SHORT = "defaults:\n  - model: tiny\n  - _self_\nmodel:\n  context_length: 64\n"


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("limits")
    d = Daemon(scenarios=make_scenarios(base / "s", names=(),
                                        extra={"capped": CAPPED, "short": SHORT}),
               state=base / "state", log_path=base / "reefd.log")
    d.start()
    yield d
    d.stop()


def test_the_scenario_cap_wins_over_what_the_client_asks(limits: Daemon) -> None:
    c = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/capped", api_key=limits.token,
                                max_retries=0))
    with c.messages.stream(model="x", max_tokens=32000, extra_body={"ignore_eos": True},
                           messages=[{"role": "user", "content": "write a novel"}]) as stream:
        msg = stream.get_final_message()  # streamed, as Claude Code asks for 32000
    assert msg.usage.output_tokens == 3 and msg.stop_reason == "max_tokens"


def test_a_prompt_over_the_context_is_the_providers_own_error(limits: Daemon) -> None:
    long = [{"role": "user", "content": "word " * 200}]
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/short/v1", api_key=limits.token,
                            max_retries=0))
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="short", messages=long)  # type: ignore[arg-type]
    body = exc.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert body["type"] == "invalid_request_error" and "64" in body["message"]
    claude = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/short",
                                     api_key=limits.token, max_retries=0))
    with pytest.raises(anthropic.BadRequestError) as aexc:
        claude.messages.create(model="short", max_tokens=5, messages=long)  # type: ignore[arg-type]
    abody = aexc.value.body
    assert isinstance(abody, dict) and abody["error"]["type"] == "invalid_request_error"
    assert abody["error"]["message"].startswith("prompt is too long")


def test_an_answer_that_would_overflow_the_context_stops_at_its_end(limits: Daemon) -> None:
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/short/v1", api_key=limits.token,
                            max_retries=0))
    answer = oai.chat.completions.create(model="short", max_tokens=500,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})
    assert answer.usage is not None
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 64
    assert answer.choices[0].finish_reason == "length"
