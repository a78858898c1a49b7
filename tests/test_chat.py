"""Chat templates rendered without torch must match transformers; tool calls parse (Hermes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reefd.serve.chat import ChatRequest, ChatTemplate, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get", "description": "d",
                                           "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


@pytest.fixture
def tiny(tiny_model: Path) -> Path:
    return tiny_model


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rendering_and_ids_match_transformers(tiny: Path, tools: list | None) -> None:
    from transformers import AutoTokenizer

    ours = ChatTemplate(tiny)
    theirs = AutoTokenizer.from_pretrained(str(tiny))
    hf_messages = json.loads(json.dumps(CONVERSATION))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"x": 1}
    text = ours.render(CONVERSATION, tools)
    assert text == theirs.apply_chat_template(hf_messages, tools=tools, tokenize=False,
                                              add_generation_prompt=True)
    ids = theirs.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert ours.encode(text) == list(ids)


def test_tool_choice_none_and_named_shape_the_prompt(tiny: Path) -> None:
    t = ChatTemplate(tiny)
    two = [*TOOLS, {"type": "function", "function": {"name": "other", "parameters": {}}}]
    base = dict(messages=[{"role": "user", "content": "x"}], max_tokens=1, tools=two)
    none = t.encode(t.render(base["messages"]))  # type: ignore[arg-type]
    assert t.prompt_ids(ChatRequest(**base, tool_choice="none")) == none  # type: ignore[arg-type]
    named = ChatRequest(**base, tool_choice={"type": "function", "function": {"name": "other"}})  # type: ignore[arg-type]
    text = t.tokenizer.decode(t.prompt_ids(named), skip_special_tokens=False)
    assert '"other"' in text and '"get"' not in text


def test_parse_hermes_tool_calls() -> None:
    content, calls = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get", "arguments": {"x": 2}}\n</tool_call>'
        '<tool_call>{"name": "put", "arguments": {}}</tool_call>')
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get", {"x": 2}), ("put", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_arguments_written_as_a_json_string_are_accepted() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}


def test_unterminated_call_at_the_end_still_parses() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "get", "arguments": {"a": "b"}}')
    assert calls[0]["function"]["name"] == "get"


@pytest.mark.parametrize("text", ["plain text", "<tool_call>not json</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'])
def test_malformed_markup_stays_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_templates_without_tools_get_them_folded_in(tmp_path: Path, tiny: Path) -> None:
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tiny, plain)
    (plain / "chat_template.jinja").write_text(  # SmolLM2's own template: no tool support
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    t = ChatTemplate(plain)
    assert not t.supports_tools
    text = t.render(CONVERSATION, TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text


def test_unrenderable_conversation_is_a_template_error(tmp_path: Path, tiny: Path) -> None:
    import shutil

    from reefd.serve.chat import TemplateError

    strict = tmp_path / "strict"
    shutil.copytree(tiny, strict)
    (strict / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    with pytest.raises(TemplateError, match="user first"):
        ChatTemplate(strict).render([{"role": "assistant", "content": "hi"}])
