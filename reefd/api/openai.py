"""OpenAI Chat Completions on the wire: `POST /v1/chat/completions`, `GET /v1/models`.

validate → convert to a ChatRequest → serve the turn (stream or not) → format. The OpenAI
shapes live here and nowhere else.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError, BodySchema, json_response, openai_body, read_json, shown
from reefd.api.turns import scenario_of, serve_turn
from reefd.config import ScenarioConfig
from reefd.loop import RECORDS, REGISTRY, STARTED_AT
from reefd.serve.chat import ChatRequest, Completion

_NUM = {"type": "number"}
_CONTENT_PART = {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["id", "function"],
              "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                             "function": {"type": "object", "required": ["name", "arguments"],
                                          "properties": {"name": {"type": "string"},
                                                         "arguments": {"type": "string"}}}}}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": _CONTENT_PART}]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
        "tool_call_id": {"type": "string"},
    },
    "allOf": [{"if": {"properties": {"role": {"const": "tool"}}},
               "then": {"required": ["tool_call_id"]}}],
}
_TOOL = {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "minLength": 1},
                                                    "description": {"type": "string"},
                                                    "parameters": {"type": "object"}}}}}
REQUEST_SCHEMA = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"]},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1},
        "stop": {"anyOf": [{"type": "string"}, {"type": "null"},
                           {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": "boolean"}}},
        "tools": {"type": ["array", "null"], "items": _TOOL},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "null"},
                                  {"type": "object", "required": ["type", "function"],
                                   "properties": {"type": {"const": "function"},
                                                  "function": {"type": "object",
                                                               "required": ["name"]}}}]},
        "presence_penalty": _NUM, "frequency_penalty": _NUM,
        "ignore_eos": {"type": "boolean"},  # SGLang's and vLLM's extension
    },
}
_BODY = BodySchema(REQUEST_SCHEMA)


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part["type"] not in ("text", "input_text", "output_text"):
            raise ApiError(400, f"{where}.{i}.type: content parts of type {shown(part['type'])} "
                           "are not supported by this model (text only)", param=f"{where}.{i}")
        parts.append(part.get("text", ""))
    return "".join(parts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A body's messages as reefd's chat messages (the body checked first: a bad one is its 400)."""
    _BODY.check(body)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs: per-token logprobs in answers are not supported yet; "
                       "every record keeps them (GET /reef/records/{receipt})", param="logprobs")
    messages = []
    for i, m in enumerate(body["messages"]):
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": _text(m.get("content"), f"messages.{i}.content")}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        messages.append(msg)
    return messages


def to_chat_request(body: dict[str, Any], cfg: ScenarioConfig) -> ChatRequest:
    messages = chat_messages(body)
    stop = body.get("stop")
    return ChatRequest(
        messages=messages,
        max_tokens=body.get("max_completion_tokens") or body.get("max_tokens") or cfg.serve.default_max_tokens,
        tools=body.get("tools") or [], tool_choice=body.get("tool_choice"), temperature=body.get("temperature"),
        top_p=body.get("top_p"), seed=body.get("seed"), stop=[stop] if isinstance(stop, str) else list(stop or []),
        ignore_eos=bool(body.get("ignore_eos")))


class OpenAIWire:
    api = "openai.chat_completions"

    def __init__(self, receipt: str, model: str, include_usage: bool):
        self.id = "chatcmpl-" + receipt
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _usage(self, c: Completion) -> dict[str, int]:
        return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens}

    def response(self, c: Completion) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish_reason}],
                "usage": self._usage(c)}

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        data: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            data["usage"] = usage
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def stream_head(self, prompt_tokens: int) -> bytes:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def stream_delta(self, text: str) -> bytes:
        return self._chunk([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])

    def stream_tail(self, c: Completion) -> bytes:
        out = b""
        for i, call in enumerate(c.tool_calls):
            delta = {"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": call["function"]}]}
            out += self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        out += self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}])
        if self.include_usage:
            out += self._chunk([], usage=self._usage(c))
        return out

    def stream_terminal(self) -> bytes:
        return b"data: [DONE]\n\n"

    def stream_error(self, err: ApiError) -> bytes:
        return b"data: " + orjson.dumps(openai_body(err)) + b"\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    scenario = scenario_of(request, body, lambda: chat_messages(body))
    chat = to_chat_request(body, scenario.cfg)
    stream = bool(body.get("stream"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return await serve_turn(request, scenario, request.app[RECORDS],
                            lambda receipt: OpenAIWire(receipt, scenario.name, include_usage), body, chat, stream)


async def list_models(request: web.Request) -> web.Response:
    names = access.visible(request, request.app[REGISTRY].scenarios)
    created = int(request.app[STARTED_AT])
    if "anthropic-version" in request.headers:
        data = [{"type": "model", "id": n, "display_name": n,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))} for n in names]
        return json_response({"data": data, "has_more": False,
                                  "first_id": names[0] if names else None,
                                  "last_id": names[-1] if names else None})
    return json_response({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "reef"} for n in names]})
