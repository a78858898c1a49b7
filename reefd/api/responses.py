"""OpenAI Responses on the wire: `POST /v1/responses`, `GET /v1/responses/{id}`.

validate → convert input items to a ChatRequest → serve the turn → format as a Response and its
event stream. Stored responses are the records themselves; this module knows no other storage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from reefd.api import access
from reefd.api.errors import (
    SCENARIO_HEADER,
    ApiError,
    BodySchema,
    json_response,
    openai_body,
    read_json,
    shown,
    shown_text,
)
from reefd.api.turns import scenario_of, serve_turn
from reefd.config import ScenarioConfig
from reefd.loop import RECORDS
from reefd.observe.conversations import owner_of
from reefd.observe.records import RecordStore
from reefd.serve.chat import ChatRequest, Completion
from reefd.serve.scenarios import Scenario

log = logging.getLogger("reefd.api")

API = "openai.responses"
_TEXT_PARTS = ("input_text", "output_text")
_CONTENT = {"type": ["string", "array"],  # not anyOf: a 400 then names the deepest bad field
            "items": {"type": "object", "required": ["type"],
                      "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}
_STR = {"type": "string"}


def _when(kind: str, then: dict[str, Any]) -> dict[str, Any]:
    return {"if": {"required": ["type"], "properties": {"type": {"const": kind}}}, "then": then}


_ITEM = {"type": "object", "properties": {"type": _STR}, "allOf": [
    {"if": {"anyOf": [{"not": {"required": ["type"]}}, {"properties": {"type": {"const": "message"}}}]},
     "then": {"required": ["role", "content"],
              "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                             "content": _CONTENT}}},
    _when("function_call", {"required": ["call_id", "name", "arguments"],
                            "properties": {"call_id": _STR, "name": _STR, "arguments": _STR}}),
    _when("function_call_output", {"required": ["call_id", "output"],
                                   "properties": {"call_id": _STR, "output": _CONTENT}}),
]}
_TOOL = {"type": "object", "required": ["type"], "properties": {"type": _STR}, "allOf": [
    _when("function", {"required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}})]}
_OPT_OBJECT = {"type": ["object", "null"]}
_OPT_STR = {"type": ["string", "null"]}
REQUEST_SCHEMA = {
    "type": "object", "required": ["model", "input"],
    "properties": {
        "model": _STR,
        "input": {"type": ["string", "array"], "items": _ITEM},
        "instructions": _OPT_STR,
        "tools": {"type": ["array", "null"], "items": _TOOL},
        "tool_choice": {"type": ["string", "object", "null"], "allOf": [
            {"if": {"type": "string"}, "then": {"enum": ["none", "auto", "required"]}},
            {"if": {"type": "object"}, "then": {"required": ["type"], "properties": {"type": _STR}}},
            _when("function", {"required": ["name"], "properties": {"name": _STR}})]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"]},
        "previous_response_id": _OPT_STR,
        # accepted and ignored
        "parallel_tool_calls": {"type": ["boolean", "null"]}, "include": {"type": ["array", "null"]},
        "reasoning": _OPT_OBJECT, "text": _OPT_OBJECT, "metadata": _OPT_OBJECT,
        "client_metadata": _OPT_OBJECT, "prompt_cache_key": _OPT_STR, "truncation": _OPT_STR,
        "user": _OPT_STR, "service_tier": _OPT_STR,
    },
}
_BODY = BodySchema(REQUEST_SCHEMA)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part["type"] not in _TEXT_PARTS:
            raise ApiError(400, f"{where}.{j}.type: content parts of type {shown(part['type'])} are not "
                           "supported by this model (text only)", param=f"{where}.{j}.type")
    return "".join(part.get("text", "") for part in content)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as OpenAI chat messages; a function call joins the assistant message before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"], f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], f"input.{i}.output")})
        elif kind != "reasoning":  # reasoning items are not replayed into the prompt
            raise ApiError(400, f"input.{i}.type: input items of type {shown(kind)} are not supported "
                           "(message, function_call, function_call_output, reasoning)",
                           param=f"input.{i}.type")
    return messages


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        if tool["type"] != "function":
            log.debug("ignoring a %r tool: Reef serves function tools only", tool["type"])
            continue
        fn = {"name": tool["name"], **{k: tool[k] for k in ("description", "parameters", "strict")
                                       if tool.get(k) is not None}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice["type"] == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    log.debug("ignoring tool_choice of type %r: Reef serves function tools only", choice["type"])
    return None


def to_chat_request(body: dict[str, Any], cfg: ScenarioConfig,
                    prior: list[dict[str, Any]] | None = None) -> ChatRequest:
    """A validated body as a ChatRequest; `prior` is the conversation of `previous_response_id`."""
    own = _own_messages(body)
    system = own[:1] if body.get("instructions") else []
    messages = [*system, *(prior or []), *own[len(system):]]
    if not messages:
        raise ApiError(400, "input: the conversation is empty", param="input")
    return ChatRequest(messages=messages, max_tokens=body.get("max_output_tokens") or cfg.serve.default_max_tokens,
                       tools=_tools(body.get("tools") or []), tool_choice=_tool_choice(body.get("tool_choice")),
                       temperature=body.get("temperature"), top_p=body.get("top_p"),
                       ignore_eos=body.get("ignore_eos") is True)  # SGLang's and vLLM's extension


def stored(store: RecordStore, scenario: Scenario, response_id: str, owner: str) -> dict[str, Any] | None:
    """The record behind a stored response of this scenario that `owner` opened (a session's owner: see
    reefd/api/access.py), or None: another token's or user's response is one that does not exist."""
    if not response_id.startswith("resp_"):
        return None
    record = store.get_record(response_id.removeprefix("resp_"))
    if (record is None or record.get("api") != API or record.get("scenario") != scenario.name
            or record["request"].get("store") is False or "response" not in record or owner_of(record) != owner):
        return None
    return record


def _own_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a body sends itself (its instructions, then its input), `previous_response_id` aside."""
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    return [*system, *input_messages(body["input"])]


def _continued(request: web.Request, store: RecordStore, body: dict[str, Any]) -> Scenario:
    """The scenario of the response `previous_response_id` names, for a call that names none (blocking)."""
    response_id = str(body.get("previous_response_id") or "")
    record = store.get_record(response_id.removeprefix("resp_")) if response_id.startswith("resp_") else None
    if isinstance(record, dict) and owner_of(record) != access.caller(request):
        record = None  # another's: as if it did not exist
    name = record.get("scenario") if isinstance(record, dict) else None
    if isinstance(name, str) and access.covers(request, name):
        return access.scenario(request, name)
    return scenario_of(request, body, lambda: _own_messages(body))


def _prior(store: RecordStore, scenario: Scenario, body: dict[str, Any], owner: str) -> list[dict[str, Any]]:
    """The previous turn's conversation, its answer included and its `instructions` left out."""
    response_id = body.get("previous_response_id")
    if not response_id:
        return []
    record = stored(store, scenario, response_id, owner)
    if record is None:
        raise ApiError(400, f"Previous response with id {shown(response_id)} not found.",
                       param="previous_response_id", code="previous_response_not_found")
    messages: list[dict[str, Any]] = record["messages"]
    return messages[1:] if record["request"].get("instructions") else messages


class ResponsesWire:
    """One Response and its event stream. Per request: it numbers the events and keeps the
    completion that `stream_tail` saw, so that `stream_terminal` can carry the final response."""

    api = API

    def __init__(self, receipt: str, model: str, body: dict[str, Any], chat: ChatRequest):
        self.id, self.msg_id = "resp_" + receipt, "msg_" + receipt
        self.model, self.body, self.chat = model, body, chat
        self.created = int(time.time())
        self._seq = 0
        self._text_open = False
        self._final: Completion | None = None

    def _envelope(self, status: str, output: list[dict[str, Any]], usage: Any = None,
                  error: Any = None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": self.chat.max_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
                "previous_response_id": b.get("previous_response_id"), "store": b.get("store") is not False,
                "temperature": self.chat.temperature, "text": {"format": {"type": "text"}},
                "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [], "top_p": self.chat.top_p,
                "usage": usage, "metadata": b.get("metadata") or {}}

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else "", "status": status}

    def _output(self, c: Completion) -> list[dict[str, Any]]:
        status = "incomplete" if c.finish_reason == "length" else "completed"
        text = [self._message(c.text or "", status)] if c.text or self._text_open else []
        return text + [self._call(call) for call in c.tool_calls]

    def response(self, c: Completion) -> dict[str, Any]:
        usage = {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
                 "total_tokens": c.prompt_tokens + c.completion_tokens,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        status = "incomplete" if c.finish_reason == "length" else "completed"
        return self._envelope(status, self._output(c), usage)

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {"type": kind, **data, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _part(self, kind: str, text: str) -> bytes:
        return self._event(kind, {"item_id": self.msg_id, "output_index": 0, "content_index": 0,
                                  "part": {"type": "output_text", "text": text, "annotations": []}})

    def stream_head(self, prompt_tokens: int) -> bytes:
        started = self._envelope("in_progress", [])
        return (self._event("response.created", {"response": started})
                + self._event("response.in_progress", {"response": started}))

    def stream_delta(self, text: str) -> bytes:
        out = b""
        if not self._text_open:  # the message item opens with the first text
            self._text_open = True
            out += self._event("response.output_item.added",
                               {"output_index": 0, "item": self._message("", "in_progress")})
            out += self._part("response.content_part.added", "")
        return out + self._event("response.output_text.delta",
            {"item_id": self.msg_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []})

    def stream_tail(self, c: Completion) -> bytes:
        self._final = c
        out = b""
        if not self._text_open and c.text:  # an engine that did not stream its text
            out += self.stream_delta(c.text)
        output = self._output(c)
        if self._text_open:
            text = c.text or ""
            out += self._event("response.output_text.done",
                {"item_id": self.msg_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []})
            out += self._part("response.content_part.done", text)
            out += self._event("response.output_item.done", {"output_index": 0, "item": output[0]})
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                out += self._stream_call(index, item)
        return out

    def _stream_call(self, index: int, item: dict[str, Any]) -> bytes:
        ids = {"item_id": item["id"], "output_index": index}
        return (self._event("response.output_item.added", {
                    "output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}})
                + self._event("response.function_call_arguments.delta",
                              {**ids, "delta": item["arguments"]})
                + self._event("response.function_call_arguments.done",
                              {**ids, "arguments": item["arguments"]})
                + self._event("response.output_item.done", {"output_index": index, "item": item}))

    def stream_terminal(self) -> bytes:
        if self._final is None:
            raise RuntimeError("stream_terminal() before stream_tail()")
        final = self.response(self._final)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self._event(kind, {"response": final})

    def stream_error(self, err: ApiError) -> bytes:
        detail = openai_body(err)["error"]
        failed = self._envelope("failed", [], error={"code": "server_error", "message": err.message})
        return (self._event("error", {"code": err.code or detail["type"], "message": err.message,
                                      "param": err.param})
                + self._event("response.failed", {"response": failed}))


async def create(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    _BODY.check(body)
    store = request.app[RECORDS]
    if request.match_info.get("scenario") or request.headers.get(SCENARIO_HEADER) or \
            not body.get("previous_response_id"):
        scenario = scenario_of(request, body, lambda: _own_messages(body))
    else:  # the response it continues was served by a scenario
        scenario = await asyncio.to_thread(_continued, request, store, body)
    owner = access.owner(request, access.user(request, scenario))
    chat = to_chat_request(body, scenario.cfg, await asyncio.to_thread(_prior, store, scenario, body, owner))
    return await serve_turn(request, scenario, store, lambda receipt: ResponsesWire(receipt, scenario.name, body, chat),
                            body, chat, bool(body.get("stream")))


async def retrieve(request: web.Request) -> web.Response:
    scenario = scenario_of(request)
    response_id = request.match_info["response_id"]
    owner = access.owner(request, access.user(request, scenario))
    record = await asyncio.to_thread(stored, request.app[RECORDS], scenario, response_id, owner)
    if record is None:
        raise ApiError(404, f"Response with id {shown(response_id)} not found.", code="response_not_found")
    return json_response(record["response"])


async def refuse_get(request: web.Request) -> web.Response:
    """Responses over WebSocket are not served: 426 tells Codex to fall back to HTTP at once."""
    if request.headers.get("Upgrade", "").lower() == "websocket":
        err = ApiError(426, "Responses over WebSocket are not supported; use POST /v1/responses",
                       code="websocket_not_supported")
        body = openai_body(err)
        body["error"]["type"] = "invalid_request_error"
        resp = json_response(body, status=426)
        resp.force_close()  # no upgrade happened: do not reuse a connection that asked for one
        return resp
    raise ApiError(405, f"method GET not allowed on {shown_text(request.path)}; use POST", headers={"Allow": "POST"})
