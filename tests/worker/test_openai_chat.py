"""The worker's /v1/chat/completions driven by the official openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.worker.support import Worker

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture
def client(worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_chat_completion(client: openai.OpenAI, tiny_model: Path) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "tiny" and reply.object == "chat.completion"


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_seeded_sampling_and_logprobs(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "seed": 42, "logprobs": True}
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert len(content) == a.usage.completion_tokens
    assert all(item.logprob <= 0 for item in content)


def test_tools_are_rendered_and_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert reply.usage is not None and plain.usage is not None
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool list is in the prompt


def test_bad_chat_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
