"""`engine: upstream`: any OpenAI-compatible provider, passed through.

Forces `stream_options.include_usage` upstream so usage is always recorded. Token ids are
absent: providers do not return them. Knows nothing about the client's wire format.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import orjson

from reefd.engines import EngineConfig, EngineError, EngineUnavailable, ModelConfig, retry_after, sse
from reefd.engines.kind_configs import UpstreamConfig
from reefd.serve.chat import ChatRequest, Completion


def upstream_body(req: ChatRequest, model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    for key in ("temperature", "top_p", "seed"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop:
        body["stop"] = req.stop
    return body


def _merge_tool_deltas(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        call = calls.setdefault(int(d.get("index", 0)), {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""


class UpstreamEngine:
    kind = "upstream"
    Config: ClassVar[type[EngineConfig]] = UpstreamConfig

    def __init__(self, cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession):
        assert cfg.url
        self.cfg = cfg
        self.adapters: dict[str, Path] = {}  # a provider serves no LoRA adapters
        self.session = session
        self.url = cfg.url.rstrip("/") + "/chat/completions"
        self.model = cfg.upstream_model or cfg.name

    @property
    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def load_adapter(self, name: str, path: Path) -> None:
        raise EngineError("an upstream provider cannot serve LoRA adapters; use engine: worker or sglang", status=400)

    async def unload_adapter(self, name: str) -> None:
        raise EngineError(f"no adapter named {name!r} is loaded", status=400)

    def model_folder(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": "ready", "url": self.cfg.url, "restarts": 0,
                "pid": None, "upstream_model": self.model}

    def count_tokens(self, req: ChatRequest) -> int:
        raise EngineError("token counting needs a local tokenizer; this scenario's engine "
                          "is an upstream provider", status=501)

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.cfg.api_key_env or "", "")
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def generate(self, req: ChatRequest, *, stream: bool = True, timeout_s: float = 600.0,
                       adapter: str | None = None) -> AsyncIterator[str | Completion]:
        if adapter is not None:
            raise EngineError("an upstream provider cannot serve LoRA adapters", status=400)
        body = upstream_body(req, self.model, stream)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        answered = False
        try:
            async with self.session.post(self.url, json=body, headers=self._headers(), timeout=timeout) as r:
                answered = True
                if r.status >= 400:
                    await self._raise(r)
                if not stream:
                    yield self._completion(orjson.loads(await r.read()))
                    return
                async for item in self._stream(r):
                    yield item
        except aiohttp.ClientError as exc:
            if answered:
                raise EngineError(f"upstream connection lost: {exc}") from exc
            raise EngineUnavailable(f"upstream {self.cfg.url} unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise EngineError(f"upstream did not answer within {timeout_s:.0f} s", status=504) from exc
        except (aiohttp.http_exceptions.HttpProcessingError, ValueError) as exc:  # a malformed answer
            raise EngineError(f"the upstream's answer could not be read: {exc}") from exc

    async def _raise(self, r: aiohttp.ClientResponse) -> None:
        text = await r.text()
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text[:500]
        if r.status in (429, 503):
            raise EngineUnavailable(f"upstream: {message}", retry_after=retry_after(r.headers.get("Retry-After")))
        # the client's own request was refused: pass the status on; a refusal of reefd's
        # credentials or a provider failure is a bad gateway, not the client's fault
        status = r.status if r.status in (400, 404, 413, 422) else 502
        raise EngineError(f"upstream answered {r.status}: {message}", status=status)

    def _completion(self, data: dict[str, Any]) -> Completion:
        choice = (data.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        usage = data.get("usage") or {}
        return Completion(text=msg.get("content"), finish_reason=choice.get("finish_reason") or "stop",
                          tool_calls=msg.get("tool_calls") or [], prompt_tokens=int(usage.get("prompt_tokens", 0)),
                          completion_tokens=int(usage.get("completion_tokens", 0)), raw_text=msg.get("content") or "")

    async def _stream(self, r: aiohttp.ClientResponse) -> AsyncIterator[str | Completion]:
        text, finish = "", "stop"
        usage: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        async for data in sse.data_lines(r.content):
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if chunk.get("error"):  # a provider failing mid-stream: never record it as complete
                raise EngineError(f"upstream error mid-stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:  # vLLM may send null here
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text += delta["content"]
                    yield delta["content"]
                _merge_tool_deltas(calls, delta.get("tool_calls") or [])
                finish = choice.get("finish_reason") or finish
        yield Completion(text=text or None, finish_reason=finish, tool_calls=[calls[i] for i in sorted(calls)],
                         prompt_tokens=int(usage.get("prompt_tokens", 0)),
                         completion_tokens=int(usage.get("completion_tokens", 0)), raw_text=text)
