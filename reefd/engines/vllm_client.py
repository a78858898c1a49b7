"""vLLM's OpenAI server, spoken as SGLangClient's methods: `/v1/completions` on token ids (or rendered text behind
sglang-router, which takes no token ids) read back into SGLang's incremental answer shape, the LoRA routes, and the
dev-mode routes a weights swap needs (pause, collective_rpc reload_weights, weight version, prefix cache, resume).
Knows nothing about chat templates, replicas or which weights an engine serves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from reefd.engines import EngineError, EngineUnavailable, TokenSample, TokenSamples, ties_embeddings
from reefd.engines import token_sampling as wire
from reefd.engines.proof import Scored
from reefd.engines.sglang_client import LAUNCH_VERSION, SGLangClient, launch_or

TOKEN_KEY = "token_id:"  # vLLM's key for a token with return_tokens_as_token_ids
PROMPT_LOGPROB_KEYS = ("echo", "prompt_logprobs", "logprob_start_len")
"""What asks vLLM for prompt logprobs: with LoRA enabled, vLLM 0.32 on CPU dies on such a request beside a LoRA
one, so reefd never sends one (the release proof asks each position as a prompt of its own: `teacher_forced`)."""


TIED_EMBEDDINGS = ("vLLM 0.32 reloads a model with tied embeddings (tie_word_embeddings) wrong: its output layer "
                   "keeps the old weights. Serve this model's weights releases with engine: worker, or untie its "
                   "embeddings (an lm_head of its own)")
"""Why a vLLM engine takes no weights swap to a model with tied embeddings (VLLMEngine's swap_limits)."""


def _id(key: str) -> int:
    return int(key[len(TOKEN_KEY):]) if key.startswith(TOKEN_KEY) else int(key)


def forced(answer: Any, tokens: list[int]) -> Scored:
    """A teacher-forced probe read from vLLM's answer to one prompt per position of `tokens`: choice j's best
    two at its one token give position j's best token, and the logprob of `tokens[j]` (None: not among them)."""
    try:
        choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        rows = [{_id(k): float(v) for k, v in c["logprobs"]["top_logprobs"][0].items()} for c in choices]
        best = [max(row, key=row.__getitem__) for row in rows]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise EngineError(f"the engine's probe answer could not be read: {exc!r}") from None
    if len(rows) != len(tokens):
        raise EngineError(f"the engine answered {len(rows)} of the probe's {len(tokens)} positions")
    return Scored([row.get(t) for row, t in zip(rows, tokens, strict=True)], best,
                  [row[b] for row, b in zip(rows, best, strict=True)])


def _finish_reason(choice: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's finish_reason and stop_reason as SGLang's {type, matched}."""
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "abort":
        return {"type": "abort", "message": "vLLM aborted the request"}
    return {"type": "length" if reason == "length" else "stop", "matched": choice.get("stop_reason")}


class Translation:
    """One answer's `/v1/completions` chunks as SGLang's incremental chunks: text and token id deltas, each token's
    [logprob, id, None] and its top-K rows sorted best first; the last chunk carries the totals, the finish reason
    and the prompt's ids as the engine consumed them."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.prompt_ids: list[int] | None = None
        self.finish: dict[str, Any] | None = None
        self.completion_tokens = 0

    def chunk(self, body: dict[str, Any], last: bool) -> dict[str, Any]:
        choices = body.get("choices") or []
        choice = choices[0] if choices else {}
        if choice.get("prompt_token_ids") is not None:
            self.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
        ids = [int(t) for t in choice.get("token_ids") or []]
        self.completion_tokens += len(ids)
        self.finish = _finish_reason(choice) or self.finish
        lps = choice.get("logprobs") or {}
        meta: dict[str, Any] = {"output_token_logprobs": [
            [lp, tid, None] for lp, tid in zip(lps.get("token_logprobs") or [], ids, strict=False)]}
        if self.top_k > 0:
            meta["output_top_logprobs"] = [self._top(row) for row in lps.get("top_logprobs") or []]
        if last:
            usage = body.get("usage") or {}
            meta.update(finish_reason=self.finish, completion_tokens=usage.get("completion_tokens",
                                                                                self.completion_tokens))
            if self.prompt_ids is not None:
                meta.update(prompt_token_ids=self.prompt_ids, prompt_tokens=len(self.prompt_ids))
        return {"text": choice.get("text") or "", "output_ids": ids, "meta_info": meta}

    def _top(self, row: dict[str, float] | None) -> list[list[Any]]:
        """vLLM's row holds the sampled token beside the top K (K or K+1 entries): the best K."""
        pairs = sorted(((float(lp), _id(key)) for key, lp in (row or {}).items()), reverse=True)
        return [[lp, tid, None] for lp, tid in pairs[:self.top_k]]


class VLLMClient(SGLangClient):
    """One vLLM server (or sglang-router in front of several): `model` is the name it serves its base weights as;
    `text_of` set means this is the router, which takes a prompt only as text (the ids' text, tokenized by vLLM
    without special tokens added; the engine's own ids come back with the answer)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, stop_ids: list[int],
                 text_of: Callable[[list[int]], str] | None = None, lora: bool = True):
        super().__init__(session, base_url)
        self.model = model
        self.stop_ids = stop_ids
        self.text_of = text_of
        self.lora = lora

    async def healthy(self, timeout_s: float = 30.0) -> bool:
        """The server generates a token (vLLM has no /health_generate)."""
        payload = {"input_ids": [self.stop_ids[0] if self.stop_ids else 0], "stream": False,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        try:
            async for _ in self.generate(payload, timeout_s):
                return True
        except (EngineError, EngineUnavailable):
            return False
        return False

    def completion_body(self, payload: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /generate payload as vLLM's /v1/completions request."""
        if self.lora and any(k in payload for k in PROMPT_LOGPROB_KEYS):
            raise EngineError("prompt logprobs are not asked of vLLM with LoRA enabled (vLLM 0.32 fails on them "
                              "beside a LoRA request)", status=400)
        sp = payload.get("sampling_params") or {}
        ids = [int(t) for t in payload["input_ids"]]
        body: dict[str, Any] = {
            "model": payload.get("lora_path") or self.model, "max_tokens": sp.get("max_new_tokens", 16),
            "temperature": sp.get("temperature", 1.0), "top_p": sp.get("top_p", 1.0),
            "top_k": sp.get("top_k", -1), "stream": bool(payload.get("stream")),
            "logprobs": int(payload.get("top_logprobs_num") or 0), "return_token_ids": True,
            "return_tokens_as_token_ids": True, "stop_token_ids": self.stop_ids,
            "ignore_eos": bool(sp.get("ignore_eos")), "skip_special_tokens": True}
        if self.text_of is not None:
            body.update(prompt=self.text_of(ids), add_special_tokens=False)
        else:
            body["prompt"] = ids
        if sp.get("stop"):
            body["stop"] = sp["stop"]
        if sp.get("sampling_seed") is not None:
            body["seed"] = sp["sampling_seed"]
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return body

    async def generate(self, payload: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        """Yields the answer in SGLang's incremental chunks (one when not streaming)."""
        body = self.completion_body(payload)
        headers = dict(headers or {})
        if payload.get("rid"):
            headers["X-Request-Id"] = str(payload["rid"])
        reading = Translation(int(payload.get("top_logprobs_num") or 0))
        pending: dict[str, Any] | None = None
        async for raw in self._answers("/v1/completions", body, timeout_s, headers):
            if not body["stream"]:
                yield reading.chunk(raw, last=True)
                return
            if pending is not None:
                yield reading.chunk(pending, last=False)
            pending = raw
        if pending is not None:
            yield reading.chunk(pending, last=True)

    async def teacher_forced(self, prompt: list[int], tokens: list[int], adapter: str | None,
                             timeout_s: float = 60.0) -> Scored:
        """No prompt logprobs beside LoRA (PROMPT_LOGPROB_KEYS): each position of `tokens` is a prompt of its own,
        `prompt` and the tokens before it, all in one request, each answered with one token and its best two
        (greedy; vLLM's prefix cache prefills what they share once)."""
        body = {"model": adapter or self.model, "prompt": [prompt + tokens[:j] for j in range(len(tokens))],
                "max_tokens": 1, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True,
                "ignore_eos": True}
        return forced(orjson.loads(await self._call("/v1/completions", body, timeout_s)), tokens)

    async def sample_tokens(self, req: TokenSample, max_tokens: int, timeout_s: float = 600.0) -> TokenSamples:
        """SamplesTokens on this server (token_sampling.completions): `/v1/completions` on the prompt's ids."""
        return await wire.completions(req, max_tokens, self.model, self.stop_ids, lambda body: wire.only(
            self._answers("/v1/completions", body, timeout_s)))

    async def load_lora_adapter(self, name: str, path: Path, timeout_s: float = 300.0) -> None:
        """200 with a plain-text body on success; errors are OpenAI-style JSON."""
        await self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout_s)

    async def unload_lora_adapter(self, name: str, timeout_s: float = 900.0) -> None:
        await self._call("/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def _call(self, path: str, body: dict[str, Any] | None, timeout_s: float,
                    params: dict[str, str] | None = None) -> bytes:
        """A vLLM control route: its body on 200; otherwise EngineError (it answered) or EngineUnavailable."""
        try:
            async with self.session.post(f"{self.base_url}{path}", json=body, params=params,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine unreachable for {path}: {exc}", retry_after=2) from exc
        if r.status != 200:
            message = raw[:300].decode(errors="replace")
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                message = orjson.loads(raw)["error"]["message"]
            raise EngineError(f"{path} failed ({r.status}): {message}", status=400 if 400 <= r.status < 500 else 502)
        return raw

    async def update_weights_from_disk(self, path: Path, version: str | None, timeout_s: float = 900.0) -> None:
        """Pause (running requests finish, new ones queue), reload the weights in place, name their version and
        read it back, drop the prefix cache the old weights filled, resume. vLLM's reload also drops the adapters
        from its LoRA cache; they load again from disk on their next request."""
        if ties_embeddings(path):  # the engine refuses such swaps first (its swap_limits); this guards the rest
            raise EngineError(f"{path}: {TIED_EMBEDDINGS}", status=400)
        await self._call("/pause", None, timeout_s, params={"mode": "wait"})
        try:
            await self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)},
                                                 "timeout": timeout_s}, timeout_s)
            await self._call("/update_weight_version", {"new_version": version or LAUNCH_VERSION}, 30.0)
            await self._call("/reset_prefix_cache", None, 30.0)
            reported, now = await self.weight_version()
            if not reported or now != version:
                raise EngineError(f"{self.base_url} reports weights {now!r} after loading {version!r}")
        finally:
            await self._call("/resume", None, 30.0)

    async def resume(self) -> None:
        await self._call("/resume", None, 30.0)

    async def weight_version(self) -> tuple[bool, str | None]:
        info = await self._get("/weight_info")
        if isinstance(info, dict) and "weight_version" in info:
            return True, launch_or(info["weight_version"])
        return False, None

    async def _get(self, path: str, timeout_s: float = 10.0) -> Any:
        async with self.session.get(f"{self.base_url}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return orjson.loads(await r.read())

    async def server_info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """SGLang's server-info keys that reefd reads, from vLLM's routes: the adapters loaded (`/v1/models`
        entries with a parent) and the weight version (`/weight_info`)."""
        models = await self._get("/v1/models", timeout_s)
        info: dict[str, Any] = {}
        if isinstance(models, dict):
            info["loaded_adapters"] = [m["id"] for m in models.get("data") or [] if m.get("parent")]
        version = await self._get("/weight_info", timeout_s)
        if isinstance(version, dict) and "weight_version" in version:
            info["weight_version"] = version["weight_version"]
        return info

    async def base_model(self) -> tuple[str, Path]:
        """The name a server serves its base weights as, and their folder (`/v1/models`)."""
        models = await self._get("/v1/models")
        for entry in (models or {}).get("data") or []:
            if not entry.get("parent"):
                return str(entry["id"]), Path(entry.get("root") or entry["id"])
        raise EngineError(f"{self.base_url}/v1/models names no base model")

    async def tokenizer_dir(self) -> Path:
        return (await self.base_model())[1]

    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        raise EngineError("vLLM takes weights from a trainer by its own transfer protocol, not SGLang's weight "
                          "update group: publish the weights as a release instead", status=400)

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> None:
        await self.init_weights_update_group()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        return None
