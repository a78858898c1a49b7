"""SamplesTokens for the SGLang-contract engines: a TokenSample checked against what the engine serves, held while
it admits no new requests, and sent to the one process its route picks, as SGLang's `/generate` payloads (one per
sample: the worker takes no `n`) or vLLM's `/v1/completions` bodies; the answers are read back into TokenSamples,
each id checked against its logprob's. Knows nothing about chat templates, or which process serves which weights."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from reefd.engines import ContextLengthExceeded, EngineError, SampledSequence, TokenSample, TokenSamples
from reefd.engines.replicas import Replica

T = TypeVar("T")
POSITIONS_AT_ONCE = 32  # vLLM: prompt positions scored at once (a request each: `position_body`)


class Client(Protocol):
    """One process's client (SGLangClient, VLLMClient): req's samples of at most max_tokens each."""

    async def sample_tokens(self, req: TokenSample, max_tokens: int, timeout_s: float) -> TokenSamples: ...


async def sample(req: TokenSample, adapters: Mapping[str, object], context_length: int | None,
                 admission: asyncio.Event, route: Callable[[], tuple[Client, Replica | None]],
                 timeout_s: float) -> TokenSamples:
    """SamplesTokens.sample_tokens: refused (400) before any process is asked when it cannot be served (an adapter
    not in `adapters`, a prompt that leaves no room in the context), else once `admission` is set on what `route`
    picks then (EngineUnavailable when nothing can take it), each sample cut at the context length."""
    req.check()
    if req.adapter is not None and req.adapter not in adapters:
        raise EngineError(f"no adapter named {req.adapter!r} is loaded (loaded: {sorted(adapters)})", status=400)
    if context_length is not None and len(req.prompt) >= context_length:
        raise ContextLengthExceeded(len(req.prompt), context_length)
    await admission.wait()
    client, replica = route()
    if replica is not None:  # sent to it directly: counted as the router-less requests are
        replica.direct += 1
    try:
        room = req.max_tokens if context_length is None else context_length - len(req.prompt)
        return await client.sample_tokens(req, min(req.max_tokens, room), timeout_s)
    finally:
        if replica is not None:
            replica.direct -= 1


async def only(answers: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A plain (not streamed) answer: the one chunk a generation route yields (its request then closed)."""
    try:
        async for answer in answers:
            return answer
    finally:
        await answers.aclose()  # type: ignore[attr-defined]
    raise EngineError("the engine ended without an answer")


async def gathered(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a finished one ignores it


def _top_k(req: TokenSample) -> int:
    return req.top_k if req.top_k is not None and req.top_k > 0 else -1


def generate_payload(req: TokenSample, max_tokens: int, index: int) -> dict[str, Any]:
    """SGLang's /generate for sample `index` (seeded seed + index); the first asks the prompt's logprobs from
    position 0 (`logprob_start_len`) when `req` does."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                              "top_k": _top_k(req)}
    if req.stop_strings:
        params["stop"] = req.stop_strings
    if req.stop_ids:
        params["stop_token_ids"] = req.stop_ids
    if req.ignore_eos:
        params["ignore_eos"] = True
    if req.seed is not None:
        params["sampling_seed"] = req.seed + index
    payload: dict[str, Any] = {"input_ids": list(req.prompt), "sampling_params": params, "return_logprob": True,
                               "stream": False, "rid": uuid.uuid4().hex}
    if req.adapter is not None:
        payload["lora_path"] = req.adapter
    if req.prompt_logprobs and index == 0:
        payload["logprob_start_len"] = 0
    return payload


def _sequence(ids: list[int], logprobs: list[float], reason: Any) -> SampledSequence:
    if reason in ("abort", None):
        raise EngineError(f"the engine did not finish a sample ({reason or 'no finish reason'})")
    if len(logprobs) != len(ids):
        raise EngineError(f"the engine gave {len(logprobs)} logprobs for {len(ids)} tokens")
    return SampledSequence(ids, logprobs, stopped=reason == "stop")


def read_generated(answers: list[dict[str, Any]], req: TokenSample) -> TokenSamples:
    """/generate answers (one per sample, the first with the prompt's logprobs if asked) as TokenSamples."""
    try:
        samples = []
        for answer in answers:
            meta = answer.get("meta_info") or {}
            ids = [int(t) for t in answer.get("output_ids") or []]
            rows = meta.get("output_token_logprobs") or []
            if [int(row[1]) for row in rows] != ids:
                raise ValueError("the output logprobs name other tokens than the output ids")
            samples.append(_sequence(ids, [float(row[0]) for row in rows],
                                     (meta.get("finish_reason") or {}).get("type")))
        prompt = None
        if req.prompt_logprobs:  # SGLang leaves logprob_start_len's own entry (position 0) unscored
            rows = (answers[0].get("meta_info") or {}).get("input_token_logprobs") or []
            if [int(row[1]) for row in rows] != list(req.prompt):
                raise ValueError(f"{len(rows)} prompt positions scored for {len(req.prompt)}")
            prompt = [None, *(None if row[0] is None else float(row[0]) for row in rows[1:])]
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise EngineError(f"the engine's sampling answer could not be read: {exc}") from None
    return TokenSamples(samples, prompt)


def completions_body(req: TokenSample, max_tokens: int, model: str, eos_ids: list[int]) -> dict[str, Any]:
    """vLLM's /v1/completions for all of req's samples (vLLM seeds sample i with seed + i); `model` serves the
    base weights, `eos_ids` end a sample unless `stop` is []."""
    body: dict[str, Any] = {
        "model": req.adapter or model, "prompt": list(req.prompt), "n": req.n, "max_tokens": max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": _top_k(req), "logprobs": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": req.ignore_eos,
        "stop_token_ids": [] if req.ignore_eos else sorted({*eos_ids, *req.stop_ids})}
    if req.stop_strings:
        body["stop"] = req.stop_strings
    if req.seed is not None:
        body["seed"] = req.seed
    return body


async def completions(req: TokenSample, max_tokens: int, model: str, eos_ids: list[int],
                      answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> TokenSamples:
    """req's samples from a vLLM server that `answer`s a /v1/completions body: one request with `n`, then the
    prompt's logprobs when asked, one position a request (`position_body`), POSITIONS_AT_ONCE at a time."""
    samples = read_completions(await answer(completions_body(req, max_tokens, model, eos_ids)), req.n)
    if not req.prompt_logprobs:
        return TokenSamples(samples)
    gate = asyncio.Semaphore(POSITIONS_AT_ONCE)

    async def position(at: int) -> float:
        async with gate:
            return read_position(await answer(position_body(req, model, at)), req.prompt[at])

    return TokenSamples(samples, [None, *await gathered(position(at) for at in range(1, len(req.prompt)))])


def read_completions(answer: dict[str, Any], n: int) -> list[SampledSequence]:
    try:
        choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        samples = [_sequence([int(t) for t in c["token_ids"]], [float(lp) for lp in c["logprobs"]["token_logprobs"]],
                             c.get("finish_reason")) for c in choices]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"the engine's sampling answer could not be read: {exc!r}") from None
    if len(samples) != n:
        raise EngineError(f"the engine answered {len(samples)} of {n} samples")
    return samples


def position_body(req: TokenSample, model: str, at: int) -> dict[str, Any]:
    """vLLM's logprob of prompt position `at` without prompt logprobs (which vLLM 0.32 with LoRA dies on beside a
    LoRA request): the prompt before it, one greedy token allowed only to be prompt[at]; vLLM reports the
    model's logprob before that filter."""
    return {"model": req.adapter or model, "prompt": list(req.prompt[:at]), "max_tokens": 1, "temperature": 0,
            "logprobs": 0, "allowed_token_ids": [req.prompt[at]], "ignore_eos": True, "return_token_ids": True,
            "return_tokens_as_token_ids": True}


def read_position(answer: dict[str, Any], token: int) -> float:
    try:
        choice = answer["choices"][0]
        if [int(t) for t in choice["token_ids"]] != [token]:
            raise ValueError(f"it answered {choice['token_ids']} where only {token} was allowed")
        return float(choice["logprobs"]["token_logprobs"][0])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise EngineError(f"the engine's prompt logprob could not be read: {exc!r}") from None
