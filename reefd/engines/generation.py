"""Generation on an SGLang-speaking engine: render and tokenize the prompt, route it to the weights it was taken
on, and read `/generate`'s ids and logprobs into a Completion. Knows nothing about adapters or weight swaps."""

from __future__ import annotations

import asyncio
import logging
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

from reefd.engines import ANY_WEIGHTS, ContextLengthExceeded, EngineError, EngineUnavailable, Prompt
from reefd.engines.replicas import ROUTING_HEADER, Replica
from reefd.engines.sglang_base import SGLangBase
from reefd.engines.sglang_client import SGLangClient, launch_or
from reefd.engines.stream import StreamGuard
from reefd.serve.chat import ChatRequest, ChatTemplate, Completion, PromptTooLong, TemplateError, parse_tool_calls

log = logging.getLogger("reefd.engine")


def top_k_rows(top: list[Any], tokens: int, k: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """SGLang's `output_top_logprobs` (per token, K `[logprob, token_id, text]`) as ids and logprobs, or None when
    the capture is partial: a token without its row, a row short of K, or an entry that is not one."""
    if len(top) != tokens:
        return None
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for row in top:
        if not isinstance(row, list) or len(row) < k:
            return None
        try:
            pairs = [(int(entry[1]), float(entry[0])) for entry in row[:k]]
        except (TypeError, ValueError, IndexError):
            return None
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps

def sampling_params(req: ChatRequest) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": req.max_tokens,
                              "temperature": 1.0 if req.temperature is None else req.temperature,
                              "top_p": 1.0 if req.top_p is None else req.top_p,
                              "top_k": -1 if req.top_k is None else req.top_k}
    if req.stop:
        params["stop"] = list(req.stop)
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.ignore_eos:
        params["ignore_eos"] = True
    return params


class Generation(SGLangBase):
    """`generate` and `count_tokens`."""

    def count_tokens(self, req: ChatRequest) -> int:
        """The prompt's tokens (blocking: call it off the event loop)."""
        if self.template is None:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} is {self.state}")
        return len(self._prompt_ids(self.template, req))

    def _prompt_ids(self, template: ChatTemplate, req: ChatRequest) -> list[int]:
        """Render and tokenize (blocking); a prompt whose text cannot fit the context is refused untokenized."""
        try:
            return template.prompt_ids(req, self.context_length)
        except TemplateError as exc:
            raise EngineError(str(exc), status=400) from exc
        except PromptTooLong as exc:
            raise ContextLengthExceeded(exc.at_least, exc.limit, at_least=True) from exc

    def _route(self, weights: str | None, tried: set[int], key: str | None = None
               ) -> tuple[SGLangClient, Replica | None]:
        """Where a request on `weights` goes: the router (or the one process) while they are the serving weights,
        else straight to a replica that has them (a request taken just before a rolling swap switched, one on
        weights on trial, or any request while the router is down or did not take it: -1 in `tried`), the
        session's own one (`key`) where it can."""
        client = self._client()
        if self.replicas is None:
            return client, None
        routed = bool(self.replicas.router_url) and -1 not in tried
        if routed and (weights == ANY_WEIGHTS or weights == self.weights.version):
            return client, None
        found = [r for r in self.replicas.replicas
                 if r.state in ("ready", "draining", "trial") and r.url and r.index not in tried
                 and (r.weights == weights or (weights == ANY_WEIGHTS and r.state == "ready"))]
        if not found:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r}: the weights "
                                    f"{weights or 'it launched with'} no longer serve; retry", retry_after=1)
        replica = found[zlib.crc32(key.encode()) % len(found)] if key else min(found, key=lambda r: r.direct)
        return self._connect(replica.url), replica

    async def _open(self, payload: dict[str, Any], timeout_s: float, routing_key: str | None,
                    weights: str | None) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]], Replica | None]:
        """The first chunk of the answer, the rest, and the replica it was sent to directly (if it was). An answer
        whose first chunk names other weights than `weights` (the router picked a replica that had just switched)
        is dropped and the request is sent again where those weights still serve."""
        tried: set[int] = set()
        while True:
            client, replica = self._route(weights, tried, routing_key)
            headers = {ROUTING_HEADER: routing_key} if routing_key and replica is None and self.replicas else None
            if replica is not None:
                replica.direct += 1
            chunks = client.generate(payload, timeout_s, headers)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                if replica is not None:
                    replica.direct -= 1
                raise EngineError("the engine answered without any output") from None
            except EngineUnavailable:
                if replica is not None:
                    replica.direct -= 1
                await chunks.aclose()  # type: ignore[attr-defined]
                if self.replicas is None or replica is not None or -1 in tried:
                    raise
                log.warning("%s: the router did not take a request (%s); sent straight to a replica",
                            self.cfg.name, self.replicas.router_url or "down")
                tried.add(-1)  # the router is down or restarting: a replica that serves takes it
                continue
            except BaseException:
                if replica is not None:
                    replica.direct -= 1
                await chunks.aclose()  # type: ignore[attr-defined]
                raise
            meta = first.get("meta_info") or {}
            if weights == ANY_WEIGHTS or "weight_version" not in meta or launch_or(meta["weight_version"]) == weights:
                return first, chunks, replica
            if self.replicas is None:  # one process: nowhere else to send it (a swap outlasted its drain wait)
                log.warning("%s: a request on weights %s was answered by weights %s", self.cfg.name, weights,
                            meta["weight_version"])
                return first, chunks, replica
            if replica is not None:
                replica.direct -= 1
            await chunks.aclose()  # type: ignore[attr-defined]
            log.info("%s: a request on weights %s reached weights %s; sent again", self.cfg.name, weights,
                     meta["weight_version"])
            tried.add(-1 if replica is None else replica.index)
            payload = {**payload, "rid": uuid.uuid4().hex}

    async def generate(self, req: ChatRequest, *, stream: bool = True, timeout_s: float = 600.0,
                       adapter: str | None = None, weights: str | None = ANY_WEIGHTS
                       ) -> AsyncIterator[Prompt | str | Completion]:
        self._client()  # not ready: EngineUnavailable
        assert self.template is not None
        # rendering and tokenizing a long prompt takes a while: off the event loop, which keeps serving others
        prompt_ids = await asyncio.to_thread(self._prompt_ids, self.template, req)
        limit = self.context_length
        params = sampling_params(req)
        if limit is not None:
            if len(prompt_ids) >= limit:
                raise ContextLengthExceeded(len(prompt_ids), limit)
            # the answer may use what the prompt leaves; it then ends with a length stop
            params["max_new_tokens"] = min(params["max_new_tokens"], limit - len(prompt_ids))
        payload = {"input_ids": prompt_ids, "sampling_params": params,
                   "return_logprob": True, "stream": stream, "rid": uuid.uuid4().hex}
        if adapter is not None:
            payload["lora_path"] = adapter  # SGLang: the name an adapter was loaded under
        if req.top_logprobs > 0:
            payload["top_logprobs_num"] = req.top_logprobs
        tools_on = bool(req.tools) and req.tool_choice != "none"
        first, chunks, replica = await self._open(payload, timeout_s, req.routing_key, weights)
        try:
            async for out in self._decode(first, chunks, prompt_ids, req, stream, tools_on):
                yield out
        finally:
            if replica is not None:
                replica.direct -= 1
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _decode(self, first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]], prompt_ids: list[int],
                      req: ChatRequest, stream: bool, tools_on: bool) -> AsyncIterator[Prompt | str | Completion]:
        guard = StreamGuard(req.stop, hold_tool_markup=tools_on)
        text = ""
        ids: list[int] = []
        logprobs: list[float | None] = []
        top: list[Any] = []
        meta: dict[str, Any] = {}
        yield Prompt(len(prompt_ids))

        async def every() -> AsyncIterator[dict[str, Any]]:
            yield first
            async for chunk in chunks:
                yield chunk

        async for chunk in every():
            meta = chunk.get("meta_info") or {}
            new_ids = chunk.get("output_ids") or []
            new_lps = meta.get("output_token_logprobs") or []
            new_top = meta.get("output_top_logprobs") or []
            chunk_text = chunk.get("text") or ""
            if len(new_ids) == meta.get("completion_tokens", -1):  # cumulative (SGLang default)
                new_ids, new_lps, new_top = new_ids[len(ids):], new_lps[len(logprobs):], new_top[len(top):]
                # the engine's text is the truth; a final text may drop a trimmed stop string
                delta = chunk_text[len(text):] if chunk_text.startswith(text) else ""
                text = chunk_text
            else:  # incremental chunks (SGLang --incremental-streaming-output)
                delta = chunk_text
                text += chunk_text
            ids.extend(new_ids)
            logprobs.extend(None if lp[0] is None else float(lp[0]) for lp in new_lps)
            top.extend(new_top)
            if delta and stream:
                out = guard.feed(delta)
                if out:
                    yield out
        completion = self._finish(text, ids, logprobs, meta, prompt_ids, req, tools_on)
        if req.top_logprobs > 0:
            captured = top_k_rows(top, len(ids), req.top_logprobs)
            completion.top_k_capture = "partial" if captured is None else "full"
            if captured is not None:
                completion.completion_top_ids, completion.completion_top_logprobs = captured
        if stream:
            tail = guard.tail(completion.text or "")
            if tail:
                yield tail
        yield completion

    def _finish(self, text: str, ids: list[int], logprobs: list[float | None], meta: dict[str, Any],
                prompt_ids: list[int], req: ChatRequest, tools_on: bool) -> Completion:
        reason = meta.get("finish_reason") or {}
        rtype = reason.get("type")
        if rtype == "abort":
            raise EngineError(f"engine aborted the request: {reason.get('message', '')}")
        matched = reason.get("matched")
        content, calls = parse_tool_calls(text) if tools_on else (text, [])
        finish = "tool_calls" if calls else ("length" if rtype == "length" else "stop")
        return Completion(
            text=content, finish_reason=finish, tool_calls=calls,
            stop_sequence=matched if isinstance(matched, str) and matched in req.stop else None,
            prompt_tokens=int(meta.get("prompt_tokens", len(prompt_ids))),
            completion_tokens=int(meta.get("completion_tokens", len(ids))), raw_text=text, prompt_token_ids=prompt_ids,
            completion_token_ids=ids, completion_logprobs=logprobs if len(logprobs) == len(ids) else None,
            weight_version=meta.get("weight_version"), weights_reported="weight_version" in meta)
