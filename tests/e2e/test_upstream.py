"""`engine: upstream` passes requests through to an OpenAI-compatible provider and records them.

Contract test: the provider is tests/fake_upstream.py on loopback (hosted providers are out of
reach here); pointing `model.url` at a real provider is the only change for production.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import Daemon, make_scenarios, sdk
from tests.fake_upstream import SEEN, build
from tests.served import aiohttp_in_thread

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, web.Application]]:
    app = build()
    with aiohttp_in_thread(app) as url:
        yield f"{url}/v1", app


@pytest.fixture(scope="module")
def proxy(upstream: tuple[str, web.Application], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("up")
    yaml = ("defaults:\n  - model: upstream\n  - _self_\nmodel:\n"
            f"  url: {upstream[0]}\n  api_key_env: UP_KEY\n  upstream_model: up-model\n"
            "serve:\n  temperature: 0.3\n")
    d = Daemon(scenarios=make_scenarios(base / "s", names=(), extra={"up": yaml}),
               state=base / "state", log_path=base / "reefd.log", env={"UP_KEY": "up-key"})
    d.start()
    yield d
    d.stop()


def test_openai_passthrough_is_recorded_without_token_ids(proxy: Daemon,
                                                          upstream: tuple[str, web.Application]
                                                          ) -> None:
    c = sdk(openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.token, max_retries=0,
                      default_headers={"x-reef-scenario": "up"}))
    raw = c.chat.completions.with_raw_response.create(
        model="up", messages=[{"role": "user", "content": "hi"}], max_tokens=9)
    answer = raw.parse()
    assert answer.choices[0].message.content == "Hello from upstream."
    sent = upstream[1][SEEN][-1]
    assert sent["body"]["model"] == "up-model" and sent["body"]["max_tokens"] == 9
    assert sent["body"]["temperature"] == 0.3  # the scenario's default fills the gap
    c.chat.completions.create(model="up", messages=[{"role": "user", "content": "hi"}],
                              temperature=0.9)
    assert upstream[1][SEEN][-1]["body"]["temperature"] == 0.9  # and never overrides a request
    rec = json.loads(proxy.get(f"/reef/records/{raw.headers['x-reef-agent-record-id']}")[1])
    assert rec["engine"] == "upstream" and rec["completion_token_ids"] is None
    assert rec["usage"] == {"prompt_tokens": 7, "completion_tokens": 4}


def test_streaming_passthrough_forces_usage_upstream(proxy: Daemon,
                                                     upstream: tuple[str, web.Application]
                                                     ) -> None:
    c = sdk(openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.token, max_retries=0,
                      default_headers={"x-reef-scenario": "up"}))
    chunks = list(c.chat.completions.create(
        model="up", messages=[{"role": "user", "content": "hi"}], stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Hello from upstream."
    assert all(ch.usage is None for ch in chunks)  # the client did not ask for usage
    assert upstream[1][SEEN][-1]["body"]["stream_options"] == {"include_usage": True}


def test_anthropic_client_over_openai_upstream_gets_tool_use(proxy: Daemon) -> None:
    c = sdk(anthropic.Anthropic(base_url=proxy.url, api_key=proxy.token, max_retries=0,
                            default_headers={"x-reef-scenario": "up"}))
    msg = c.messages.create(model="up", max_tokens=20,
                            tools=[{"name": "search", "input_schema": {"type": "object"}}],
                            messages=[{"role": "user", "content": "find"}])
    assert msg.stop_reason == "tool_use"
    block = msg.content[0]
    assert block.type == "tool_use" and block.name == "search" and block.input == {"q": 1}


def test_upstream_auth_failure_is_passed_on(proxy: Daemon, upstream: tuple[str, web.Application],
                                            own_scenario: Callable[..., str]) -> None:
    yaml = (f"defaults:\n  - model: upstream\n  - _self_\nmodel:\n  url: {upstream[0]}\n"
            "  api_key_env: NO_SUCH_KEY\n")  # a variable reefd does not have
    name = own_scenario(proxy, yaml, prefix="nokey")
    status, body, _ = proxy.post("/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-reef-scenario": name})
    assert status == 502 and "bad upstream key" in body["error"]["message"]
