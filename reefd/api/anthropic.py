"""Anthropic Messages on the wire: `POST /v1/messages` and `/v1/messages/count_tokens`.

validate → convert to a ChatRequest → serve the turn (stream or not) → format. The
Anthropic shapes live here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from aiohttp import web

from reefd.api.errors import ApiError, BodySchema, anthropic_body, json_response, read_json, shown
from reefd.api.turns import scenario_of, serve_turn
from reefd.loop import RECORDS
from reefd.serve.chat import ChatRequest, Completion

_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_BLOCK = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
          "allOf": [
              {"if": {"properties": {"type": {"const": "text"}}}, "then": _TEXT_BLOCK},
              {"if": {"properties": {"type": {"const": "tool_use"}}},
               "then": {"required": ["id", "name", "input"],
                        "properties": {"id": {"type": "string"}, "name": {"type": "string"},
                                       "input": {"type": "object"}}}},
              {"if": {"properties": {"type": {"const": "tool_result"}}},
               "then": {"required": ["tool_use_id"],
                        "properties": {"tool_use_id": {"type": "string"},
                                       "is_error": {"type": "boolean"},
                                       "content": {"anyOf": [
                                           {"type": "string"},
                                           {"type": "array", "items": {"type": "object"}}]}}}},
          ]}
_BASE_PROPS = {
    "model": {"type": "string"},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant", "system"]},
                       "content": {"anyOf": [{"type": "string"},
                                             {"type": "array", "items": _BLOCK}]}}}},
    "tools": {"type": "array", "items": {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1},
                       "description": {"type": "string"},
                       "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "required": ["type"],
                    "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                                   "name": {"type": "string"}}},
}
REQUEST_SCHEMA = {
    "type": "object", "required": ["model", "max_tokens", "messages"],
    "properties": {
        **_BASE_PROPS,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
        "ignore_eos": {"type": "boolean"},  # SGLang's and vLLM's extension
    },
}
COUNT_SCHEMA = {"type": "object", "required": ["model", "messages"], "properties": _BASE_PROPS}
_BODY = BodySchema(REQUEST_SCHEMA)
_COUNT_BODY = BodySchema(COUNT_SCHEMA)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")


def _convert_message(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(m["content"], str):
        return [{"role": m["role"], "content": m["content"]}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m["content"]):
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and m["role"] == "user":
            text = _result_text(block.get("content"))
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": ("[error] " + text) if block.get("is_error") else text})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # not replayed into the prompt
        else:
            raise ApiError(400, f"messages.{i}.content.{j}.type: {shown(kind)} blocks are not "
                           f"supported in {m['role']} messages by this model",
                           param=f"messages.{i}.content.{j}.type")
    out: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": m["role"], "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(b["text"] for b in content or [] if b.get("type") == "text")


def to_chat_request(body: dict[str, Any], max_tokens: int = 1) -> ChatRequest:
    """Claude Code also puts `role: "system"` entries inside `messages`: they are folded, in
    order, into the one system prompt after the top-level `system`."""
    messages: list[dict[str, Any]] = []
    system = [_text_of(body["system"])] if body.get("system") else []
    for i, m in enumerate(body["messages"]):
        if m["role"] == "system":
            system.append(_text_of(m["content"]))
        else:
            messages.extend(_convert_message(i, m))
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    tools = [{"type": "function", "function": {"name": t["name"],
                                               "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}}
             for t in body.get("tools") or []]
    choice = body.get("tool_choice") or {}
    tool_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(choice.get("type")))
    if choice.get("type") == "tool":
        tool_choice = {"type": "function", "function": {"name": choice.get("name", "")}}
    return ChatRequest(messages=messages, max_tokens=body.get("max_tokens", max_tokens), tools=tools,
                       tool_choice=tool_choice, temperature=body.get("temperature"), top_p=body.get("top_p"),
                       top_k=body.get("top_k"), stop=list(body.get("stop_sequences") or []),
                       ignore_eos=bool(body.get("ignore_eos")))


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class AnthropicWire:
    api = "anthropic.messages"

    def __init__(self, receipt: str, model: str):
        self.id = "msg_" + receipt
        self.model = model
        self._text_open = False
        self._blocks = 0

    def _content(self, c: Completion) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": c.text}] if c.text else []
        for call in c.tool_calls:
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):  # tool_use.input must be an object
                args = {"_raw": call["function"]["arguments"]}
            blocks.append({"type": "tool_use", "id": _tool_id(call["id"]),
                           "name": call["function"]["name"], "input": args})
        return blocks

    def _stop(self, c: Completion) -> tuple[str, str | None]:
        if c.stop_sequence is not None:
            return "stop_sequence", c.stop_sequence
        return _STOP_REASONS.get(c.finish_reason, "end_turn"), None

    def response(self, c: Completion) -> dict[str, Any]:
        reason, seq = self._stop(c)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self._content(c), "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def stream_head(self, prompt_tokens: int) -> bytes:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return (_event("message_start", {"type": "message_start", "message": message})
                + _event("ping", {"type": "ping"}))

    def stream_delta(self, text: str) -> bytes:
        out = b""
        if not self._text_open:
            self._text_open = True
            out += _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
        return out + _event("content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})

    def stream_tail(self, c: Completion) -> bytes:
        out = b""
        index = 0
        if not self._text_open and c.text:  # an engine that did not stream its text
            out += self.stream_delta(c.text)
        if self._text_open:
            out += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        for block in self._content(c):
            if block["type"] != "tool_use":
                continue
            start = {**block, "input": {}}
            out += _event("content_block_start", {"type": "content_block_start",
                                                  "index": index, "content_block": start})
            out += _event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        reason, seq = self._stop(c)
        return out + _event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens}})

    def stream_terminal(self) -> bytes:
        return _event("message_stop", {"type": "message_stop"})

    def stream_error(self, err: ApiError) -> bytes:
        return _event("error", anthropic_body(err))


async def messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    _BODY.check(body)
    chat = to_chat_request(body)
    scenario = scenario_of(request, body, lambda: chat.messages)
    return await serve_turn(request, scenario, request.app[RECORDS],
                            lambda receipt: AnthropicWire(receipt, scenario.name), body, chat, bool(body.get("stream")))


async def count_tokens(request: web.Request) -> web.Response:
    scenario = scenario_of(request)
    body = await read_json(request)
    _COUNT_BODY.check(body)
    tokens = await asyncio.to_thread(scenario.engine.count_tokens, to_chat_request(body))  # long prompts take a while
    return json_response({"input_tokens": tokens})
