"""OpenAI `/v1/chat/completions` on the worker: render with the model's chat template, generate.

Owns the OpenAI chat wire shapes (message, chunk, usage, logprobs) and Hermes `<tool_call>`
parsing. Knows nothing about torch; generation goes through the same batcher as `/generate`.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from reefd.serve.chat import parse_tool_calls  # the same parser reefd uses (torch-free)
from reefd.worker.detok import held_back
from reefd.worker.generation import Generation
from reefd.worker.params import BadRequest, GenerateRequest, parse_sampling
from reefd.worker.wire import STATE, WorkerState, close_sse, error_response, open_sse, read_json, send_sse, updates

_FINISH = {"length": "length", "stop": "stop"}
# Other OpenAI fields (model, user, metadata, parallel_tool_calls, ...) are accepted and ignored.
_NEUTRAL = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": 0}


def _request(state: WorkerState, body: Any) -> tuple[GenerateRequest, dict[str, Any]]:
    """Validate an OpenAI chat body; return the generation request and the reply options."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of message objects")
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise BadRequest(f"{key}={body[key]!r} is not supported by this worker")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("max_tokens must be a positive integer")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise BadRequest("response_format other than text is not supported by this worker")
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of tool objects")
    sampling = parse_sampling({
        "max_new_tokens": max_tokens if max_tokens is not None else state.batcher.engine.context_length,
        **{key: body.get(key) for key in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids")},
        "ignore_eos": body.get("ignore_eos") or False, "sampling_seed": body.get("seed")})
    try:
        prompt = state.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                     tokenize=False)
    except Exception as exc:  # template errors are the caller's message shapes
        raise BadRequest(f"cannot render the chat template: {exc}") from None
    ids = list(state.tokenizer.encode(prompt, add_special_tokens=False))
    logprobs = body.get("logprobs") or False
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object")
    req = GenerateRequest(lora_path=_adapter(state, body), input_ids=ids, text=None, sampling=sampling,
                          return_logprob=bool(logprobs), stream=bool(body.get("stream", False)))
    options = {"tools": bool(tools), "include_usage": bool(stream_options.get("include_usage"))}
    return req, options


def _adapter(state: WorkerState, body: dict[str, Any]) -> str | None:
    """SGLang's adapter selection: `lora_path` (a loaded name), or `model: "base:adapter"`.

    A `model` with a colon selects an adapter only when the part after the first colon is a
    loaded adapter's name; any other `model` is ignored, as before.
    """
    lora = body.get("lora_path")
    if lora is not None:
        if not isinstance(lora, str):
            raise BadRequest("lora_path must be the name of a loaded adapter")
        return lora or None
    model = body.get("model")
    if isinstance(model, str) and ":" in model:
        adapter = model.split(":", 1)[1]
        if adapter in state.batcher.engine.adapters:
            return adapter
    return None


def _logprobs(state: WorkerState, ids: list[int], values: list[float]) -> dict[str, Any]:
    content = []
    for token, value in zip(ids, values, strict=True):
        text = state.tokenizer.decode([token])
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def _usage(job: Generation, completion: int) -> dict[str, int]:
    prompt = len(job.prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req, options = _request(state, await read_json(request))
    await state.admit()
    job = state.batcher.submit(req, req.input_ids or [])
    if req.stream:
        return await _stream(request, state, job, options)
    ids: list[int] = []
    values: list[float] = []
    parts: list[str] = []
    finish = None
    async with aclosing(updates(job)) as stream:
        async for update in stream:
            ids += update.new_ids
            values += update.new_logprobs
            parts.append(update.new_text)
            finish = update.finish
    text = "".join(parts)
    if finish and finish.get("type") == "abort":
        return error_response(503, str(finish.get("message")), "server_error")
    content, calls = parse_tool_calls(text) if options["tools"] else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reason = _FINISH.get(str(finish and finish.get("type")), "stop")
    if calls:
        message["tool_calls"], reason = calls, "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": reason,
              "logprobs": _logprobs(state, ids, values) if req.return_logprob else None}
    return web.json_response({"id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": int(time.time()),
                              "model": state.served_model_name, "choices": [choice], "usage": _usage(job, len(ids))})


def _streamable(text: str, final: bool, tools: bool) -> str:
    """The content that can be streamed: with tools, nothing from a `<tool_call>` on."""
    if not tools or (final and not parse_tool_calls(text)[1]):
        return text
    if "<tool_call>" in text:
        return text[: text.index("<tool_call>")]
    return text if final else text[: len(text) - held_back(text, ["<tool_call>"])]


async def _stream(request: web.Request, state: WorkerState, job: Generation,
                  options: dict[str, Any]) -> web.StreamResponse:
    """SSE chunks: a role delta, content deltas, (tool calls), a finish chunk, optional usage."""
    response = await open_sse(request)
    base = {"id": f"chatcmpl-{job.req.rid}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.served_model_name}

    async def chunk(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        await send_sse(response, {**base, "choices": [choice]})

    await chunk({"role": "assistant", "content": ""})
    shown, total, text, finish = 0, 0, "", None
    async with aclosing(updates(job)) as stream:
        async for update in stream:
            total += len(update.new_ids)
            text, finish = text + update.new_text, update.finish
            safe = _streamable(text, finish is not None, options["tools"])
            lp = _logprobs(state, update.new_ids, update.new_logprobs) if job.req.return_logprob else None
            if len(safe) > shown or lp:
                await chunk({"content": safe[shown:]}, logprobs=lp)
                shown = max(shown, len(safe))
    if finish and finish.get("type") == "abort":  # shutdown cut it: say so, never a clean finish
        await send_sse(response, {"error": {"message": str(finish.get("message")), "type": "server_error"}})
        return await close_sse(response)
    _, calls = parse_tool_calls(text) if options["tools"] else (text, [])
    if calls:
        await chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    reason = "tool_calls" if calls else _FINISH.get(str(finish and finish.get("type")), "stop")
    await chunk({}, reason)
    if options["include_usage"]:
        await send_sse(response, {**base, "choices": [], "usage": _usage(job, total)})
    return await close_sse(response)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.served_model_name, "object": "model", "created": int(state.started), "owned_by": "reefd"}
    return web.json_response({"object": "list", "data": [card]})
