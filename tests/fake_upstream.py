"""A trivially fast OpenAI-compatible provider on loopback.

A stand-in for a hosted provider, which this machine cannot reach: tests of the `upstream`
engine are contract tests against it, and bench/proxy_overhead.py measures reefd against it.
Run alone: `python tests/fake_upstream.py --port N`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ANSWER = "Hello from upstream."
SEEN = web.AppKey("seen", list)
SCRIPT = web.AppKey("script", str)  # a file whose current content is the answer (a scripted provider)
ECHO = web.AppKey("echo", bool)  # answer with the request's system message: a model that repeats its instructions


def _completion(body: dict[str, Any], answer: str = ANSWER) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    finish = "stop"
    if body.get("tools") and body.get("tool_choice") != "none":
        name = body["tools"][0]["function"]["name"]
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_up1", "type": "function",
            "function": {"name": name, "arguments": "{\"q\": 1}"}}]}
        finish = "tool_calls"
    return {"id": "chatcmpl-up", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "up"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}


async def chat(request: web.Request) -> web.StreamResponse:
    request.app[SEEN].append({"headers": dict(request.headers), "body": await request.json()})
    body = request.app[SEEN][-1]["body"]
    if request.headers.get("Authorization") != "Bearer up-key":
        return web.json_response({"error": {"message": "bad upstream key", "type": "x"}},
                                 status=401)
    script = request.app[SCRIPT]
    answer = Path(script).read_text() if script else ANSWER
    if request.app[ECHO]:
        system = [m.get("content") for m in body.get("messages") or [] if m.get("role") == "system"]
        answer = str(system[0]) if system else ""
    full = _completion(body, answer)
    if not body.get("stream"):
        return web.json_response(full)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    base = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    msg = full["choices"][0]["message"]
    chunks: list[dict[str, Any]] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    if msg.get("content"):
        chunks += [{"index": 0, "delta": {"content": w}} for w in ("Hello ", "from ", "upstream.")]
    for i, call in enumerate(msg.get("tool_calls") or []):
        chunks.append({"index": 0, "delta": {"tool_calls": [{
            "index": i, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""}}]}})
        chunks.append({"index": 0, "delta": {"tool_calls": [{
            "index": i, "function": {"arguments": call["function"]["arguments"]}}]}})
    chunks.append({"index": 0, "delta": {}, "finish_reason": full["choices"][0]["finish_reason"]})
    for choice in chunks:
        await resp.write(b"data: " + json.dumps({**base, "choices": [choice]}).encode() + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {**base, "choices": None, "usage": full["usage"]}  # vLLM style null choices
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def build(script: str = "", echo: bool = False) -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app[SCRIPT] = script
    app[ECHO] = echo
    app.router.add_post("/v1/chat/completions", chat)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--answer-file", default="", help="answer with this file's content (read per request)")
    args = ap.parse_args()
    web.run_app(build(args.answer_file), host="127.0.0.1", port=args.port, access_log=None, print=None)
