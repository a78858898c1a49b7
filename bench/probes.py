"""A process's greedy answer to a prompt, through reefd's own client (any SGLang-speaking engine, or vLLM through
VLLMClient): what bench/gpu_check.py judges each change on, and the release proof reefd ran before it
teacher-forced (bench/proof_cost.py measures the two side by side)."""

from __future__ import annotations

from typing import Any

from reefd.engines import EngineError
from reefd.engines.sglang_client import SGLangClient


async def greedy(client: SGLangClient, prompt: list[int], max_tokens: int, adapter: str | None,
                 timeout_s: float = 60.0) -> tuple[list[int], list[float]]:
    """The process's greedy answer to `prompt` (token ids): exactly `max_tokens` ids and their logprobs, decoded
    one token a step."""
    payload: dict[str, Any] = {"input_ids": prompt, "return_logprob": True, "stream": False,
                               "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True}}
    if adapter is not None:
        payload["lora_path"] = adapter
    async for answer in client.generate(payload, timeout_s):
        meta = answer.get("meta_info") or {}
        return ([int(t) for t in answer.get("output_ids") or []],
                [float(e[0]) for e in meta.get("output_token_logprobs") or []])
    raise EngineError("the engine ended without an answer")
