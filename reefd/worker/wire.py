"""HTTP plumbing shared by the SGLang and OpenAI routes: app state, errors, SSE, job updates.

Owns how a running job is consumed from the event loop (coalesced updates, cancel on exit).
Knows nothing about torch or about either protocol's body shapes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from reefd.worker.batcher import Batcher
from reefd.worker.generation import Generation, Update
from reefd.worker.params import BadRequest


@dataclass
class WorkerState:
    """Everything the routes need: the batcher, a loop-side tokenizer and identity."""

    batcher: Batcher
    tokenizer: Any  # a second tokenizer instance: the batcher thread owns the engine's
    model_path: str
    served_model_name: str
    version: str
    started: float = field(default_factory=time.time)
    draining: bool = False
    incremental: bool = False  # SGLang's --incremental-streaming-output: stream events carry only what is new
    running: asyncio.Event = field(default_factory=asyncio.Event)  # clear while generation is paused

    def __post_init__(self) -> None:
        self.running.set()

    async def admit(self) -> None:
        """Wait while generation is paused (SGLang's /pause_generation), as SGLang holds new requests."""
        await self.running.wait()


STATE = web.AppKey("reefd_worker_state", WorkerState)


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """BadRequest → 400, draining → 503, anything unexpected → 500, all as JSON errors."""
    state = request.app[STATE]
    if state.draining and request.method == "POST":
        return error_response(503, "the worker is shutting down", "server_error")
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except BadRequest as exc:
        return error_response(400, str(exc))
    except web.HTTPException:
        raise
    except RuntimeError as exc:
        if "shutting down" in str(exc):
            return error_response(503, str(exc), "server_error")
        raise


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


def merge(a: Update, b: Update) -> Update:
    """Two consecutive updates of one job as one."""
    first = a if a.input_logprobs is not None else b  # the update that carries the prompt's logprobs, if any
    return Update(
        a.new_ids + b.new_ids, a.new_logprobs + b.new_logprobs, a.new_text + b.new_text, b.finish,
        first.input_logprobs, a.new_top_logprobs + b.new_top_logprobs, first.input_top_logprobs)


async def updates(job: Generation) -> AsyncGenerator[Update, None]:
    """Yield the job's updates, coalescing any backlog; cancel the job if the consumer leaves."""
    finished = False
    try:
        while not finished:
            update = await job.queue.get()
            while not job.queue.empty() and update.finish is None:
                update = merge(update, job.queue.get_nowait())
            finished = update.finish is not None
            yield update
    finally:
        if not finished:
            job.cancelled = True


async def open_sse(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        **(headers or {})})
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await response.write(f"data: {data}\n\n".encode())


async def close_sse(response: web.StreamResponse) -> web.StreamResponse:
    await send_sse(response, "[DONE]")
    await response.write_eof()
    return response
