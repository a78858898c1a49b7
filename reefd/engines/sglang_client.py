"""SGLang's HTTP contract, which `python -m reefd.worker` speaks too: /generate, health, LoRA and weight updates,
server info. Knows nothing about chat templates, replicas or which weights an engine serves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from reefd.engines import EngineError, EngineUnavailable, TokenSample, TokenSamples, retry_after, sse
from reefd.engines import token_sampling as wire
from reefd.engines.proof import Scored

LAUNCH_VERSION = "default"  # SGLang's weight_version for the weights a server launched with


def launch_or(version: Any) -> str | None:
    """A reported weight version, with the launch weights' ("default", or none at all) as None."""
    return None if version in (None, LAUNCH_VERSION) else str(version)


class SGLangClient:
    """One server's routes: /generate (plain or streamed), health, LoRA and weight updates, server info."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session = session
        self.base_url = base_url.rstrip("/")

    async def alive(self, timeout_s: float = 10.0) -> bool:
        """The server answers at all (`/health`), even while every batch slot is busy."""
        return await self._ok("/health", timeout_s)

    async def teacher_forced(self, prompt: list[int], tokens: list[int], adapter: str | None,
                             timeout_s: float = 60.0) -> Scored:
        """This process's answer at each of `tokens` following `prompt`, in one prefill: SGLang's prompt
        logprobs from `logprob_start_len`, whose own entry SGLang leaves unscored (so it starts at the prompt's
        last token), and the best token at each position (`input_top_logprobs`, top_logprobs_num 1)."""
        payload: dict[str, Any] = {"input_ids": prompt + tokens, "return_logprob": True, "stream": False,
                                   "logprob_start_len": len(prompt) - 1, "top_logprobs_num": 1,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
        if adapter is not None:
            payload["lora_path"] = adapter
        async for answer in self.generate(payload, timeout_s):
            try:
                meta = answer.get("meta_info") or {}
                scored = (meta.get("input_token_logprobs") or [])[1:]
                tops = [row[0] for row in (meta.get("input_top_logprobs") or [])[1:]]
                if [int(e[1]) for e in scored] != tokens or len(tops) != len(tokens):
                    raise ValueError(f"{len(scored)} positions scored, {len(tops)} ranked, for {len(tokens)} tokens")
                return Scored([None if e[0] is None else float(e[0]) for e in scored], [int(t[1]) for t in tops],
                              [float(t[0]) for t in tops])
            except (TypeError, ValueError, IndexError, AttributeError) as exc:
                raise EngineError(f"the engine's probe answer could not be read: {exc}") from None
        raise EngineError("the engine ended without an answer")

    async def sample_tokens(self, req: TokenSample, max_tokens: int, timeout_s: float = 600.0) -> TokenSamples:
        """SamplesTokens on this process: req.n `/generate` requests at once on the prompt's ids (the worker takes
        no `n`), sample i seeded seed + i, the first asking the prompt's logprobs when `req` does."""
        answers = await wire.gathered(wire.only(self.generate(wire.generate_payload(req, max_tokens, i), timeout_s))
                                      for i in range(req.n))
        return wire.read_generated(answers, req)

    async def healthy(self, timeout_s: float = 30.0) -> bool:
        """The server generates a token (`/health_generate`)."""
        return await self._ok("/health_generate", timeout_s)

    async def _ok(self, path: str, timeout_s: float) -> bool:
        try:
            async with self.session.get(f"{self.base_url}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def load_lora_adapter(self, name: str, path: Path, timeout_s: float = 300.0) -> None:
        """SGLang's LoRAUpdateOutput: {success, error_message, loaded_adapters}; failures raise EngineError."""
        await self._admin_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout_s,
                               "error_message")

    async def unload_lora_adapter(self, name: str, timeout_s: float = 900.0) -> None:
        await self._admin_call("/unload_lora_adapter", {"lora_name": name}, timeout_s, "error_message")

    async def _admin_call(self, path: str, body: dict[str, Any], timeout_s: float, message_key: str) -> None:
        """An SGLang admin route answering {success, <message_key>, ...}: failures raise EngineError (the server
        answered) or EngineUnavailable (it did not)."""
        try:
            async with self.session.post(f"{self.base_url}{path}", json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine unreachable for {path}: {exc}", retry_after=2) from exc
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = {}
        if r.status != 200 or not isinstance(answer, dict) or not answer.get("success"):
            message = answer.get(message_key) if isinstance(answer, dict) else None
            raise EngineError(f"{path} failed ({r.status}): {message or raw[:300].decode(errors='replace')}",
                              status=400 if 400 <= r.status < 500 else 502)

    async def update_weights_from_disk(self, path: Path, version: str | None, timeout_s: float = 900.0) -> None:
        """SGLang's UpdateWeightFromDiskReqInput: the server waits for its running requests, then loads `path`;
        `weight_version` names the weights in every answer's meta_info afterwards. Failures raise EngineError and
        leave the old weights serving."""
        body = {"model_path": str(path), "abort_all_requests": False, "weight_version": version or LAUNCH_VERSION}
        await self._admin_call("/update_weights_from_disk", body, timeout_s, "message")

    async def weight_version(self) -> tuple[bool, str | None]:
        """(reported, version): the server's weight version (`/get_weight_version`, else its server info), with
        SGLang's name for the weights it launched with read as None."""
        for path, key in (("/get_weight_version", "weight_version"), ("/get_server_info", "weight_version")):
            async with self.session.get(f"{self.base_url}{path}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    continue
                info = orjson.loads(await r.read())
            if isinstance(info, dict) and key in info:
                return True, launch_or(info[key])
        return False, None

    async def continue_generation(self) -> None:
        """Generation resumes after a pause (`/continue_generation`); a server that answers nothing is let be."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.session.post(f"{self.base_url}/continue_generation", json={},
                                         timeout=aiohttp.ClientTimeout(total=30)):
                pass

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str, backend: str, timeout_s: float = 600.0) -> None:
        """SGLang's InitWeightsUpdateGroupReqInput: join the trainer's group as rank `rank_offset` (blocks until
        the whole group has joined)."""
        await self._admin_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout_s, "message")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: str | None, group_name: str, timeout_s: float = 900.0) -> None:
        """SGLang's UpdateWeightsFromDistributedReqInput: receive the named tensors as the trainer (rank 0)
        broadcasts them, then serve them as `version`."""
        await self._admin_call("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True,
            "abort_all_requests": False, "weight_version": version or LAUNCH_VERSION}, timeout_s, "message")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._admin_call("/destroy_weights_update_group", {"group_name": group_name}, 60.0, "message")

    async def server_info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        async with self.session.get(f"{self.base_url}/get_server_info",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            info = orjson.loads(await r.read())
        return info if isinstance(info, dict) else {}

    async def loaded_adapters(self) -> set[str] | None:
        """The adapters the server reports loaded (`/get_server_info`), or None when it does not say."""
        found = (await self.server_info()).get("loaded_adapters")
        return set(found) if isinstance(found, dict | list) else None

    async def tokenizer_dir(self) -> Path:
        """The server's tokenizer folder (`/get_model_info`)."""
        async with self.session.get(f"{self.base_url}/get_model_info") as r:
            r.raise_for_status()
            info = orjson.loads(await r.read())
        return Path(info.get("tokenizer_path") or info["model_path"])

    def generate(self, payload: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None
                 ) -> AsyncIterator[dict[str, Any]]:
        """Yields the engine's answer chunks (one when not streaming)."""
        return self._answers("/generate", payload, timeout_s, headers)

    async def _answers(self, path: str, payload: dict[str, Any], timeout_s: float,
                       headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """A generation route's JSON answer, or its stream's events up to [DONE]; errors as EngineError (it
        answered) or EngineUnavailable (busy, draining, or the request never started)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        answered = False
        try:
            async with self.session.post(f"{self.base_url}{path}", json=payload, headers=headers,
                                         timeout=timeout) as r:
                answered = True
                if r.status in (429, 503):  # busy or draining: the caller may retry
                    raise EngineUnavailable(f"engine answered {r.status}: "
                                            f"{(await r.text())[:500]}",
                                            retry_after=retry_after(r.headers.get("Retry-After")))
                if r.status != 200:
                    raise EngineError(f"engine answered {r.status}: {(await r.text())[:500]}",
                                      status=502 if r.status >= 500 else 400)
                if not payload.get("stream"):
                    yield dict(orjson.loads(await r.read()))
                    return
                async for data in sse.data_lines(r.content):
                    if data == b"[DONE]":
                        return
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        raise EngineError(f"engine error: {chunk['error']}")
                    yield chunk
                # a stream that stops without its [DONE] was cut (a replica died behind the router): not an answer
                raise EngineError("the engine's stream ended before its last event (the engine may have died)")
        except aiohttp.ClientConnectionError as exc:
            if not answered:  # the process is gone or restarting: the request never started
                raise EngineUnavailable(f"engine unreachable: {exc}", retry_after=2) from exc
            raise EngineError(f"engine connection lost: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(f"engine connection failed: {exc}") from exc
        except TimeoutError as exc:
            raise EngineError(f"engine did not answer within {timeout_s:.0f} s", status=504) from exc
        except (aiohttp.http_exceptions.HttpProcessingError, ValueError) as exc:  # a malformed answer
            raise EngineError(f"the engine's answer could not be read: {exc}") from exc
