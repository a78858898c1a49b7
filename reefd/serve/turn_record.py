"""A turn's record as the store keeps it: what served it (scenario, release, engine), what the engine was asked,
and what came back (text, the engine's token ids and logprobs, top-K, usage, timings). Served turns, shadow copies
and practice rollouts are all written this way. Knows nothing about HTTP or the store.
"""

from __future__ import annotations

import time
from typing import Any

from reefd.observe.conversations import chain
from reefd.serve.chat import ChatRequest, Completion
from reefd.serve.scenarios import Binding, Scenario


def served_by(scenario: Scenario, binding: Binding, receipt: str) -> dict[str, Any]:
    """A record's id and what answered it: the scenario, its release (adapter, harness, weights) and engine."""
    return {"id": receipt, "scenario": scenario.name, "release": binding.release, "adapter": binding.adapter,
            "harness": binding.release if binding.harness is not None and scenario.cfg.harness.inject else None,
            "weights": binding.weights_version, "engine": scenario.engine.kind, "model": scenario.cfg.model.name}


def asked(chat: ChatRequest) -> dict[str, Any]:
    """A record's view of what the engine was asked: the messages, tools and sampling."""
    return {"messages": chat.messages, "tools": chat.tools,
            "sampling": {"temperature": chat.temperature, "top_p": chat.top_p, "max_tokens": chat.max_tokens}}


def top_k_fields(c: Completion) -> dict[str, Any]:
    """The top-K capture as the record keeps it: flat arrays (K per token), stored as raw arrays by recordcodec."""
    if c.top_k_capture is None:
        return {}
    if c.completion_top_ids is None or c.completion_top_logprobs is None:
        return {"top_k_capture": c.top_k_capture}
    k = len(c.completion_top_ids[0]) if c.completion_top_ids else 0
    return {"top_k_capture": c.top_k_capture, "top_k": k,
            "completion_top_ids": [t for row in c.completion_top_ids for t in row],
            "completion_top_logprobs": [lp for row in c.completion_top_logprobs for lp in row]}


def finish_record(record: dict[str, Any], c: Completion, answer: dict[str, Any],
                  started: float, ttft: float | None) -> None:
    assistant: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        assistant["tool_calls"] = c.tool_calls
    now = time.monotonic()
    if isinstance(record.get("conversation"), dict):  # what a continuation's prefix holds at the reply's slot
        record["conversation"]["reply"] = chain(record["conversation"]["request"], assistant)
    record.update({
        "response": answer, "messages": [*record["messages"], assistant], "finish_reason": c.finish_reason,
        "stop_sequence": c.stop_sequence, "raw_text": c.raw_text, "prompt_token_ids": c.prompt_token_ids,
        "completion_token_ids": c.completion_token_ids, "completion_logprobs": c.completion_logprobs, **top_k_fields(c),
        "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens},
        **({"engine_weights": c.weight_version} if c.weights_reported else {}), "latency_s": round(now - started, 6),
        "ttft_s": round(ttft - started, 6) if ttft is not None else None, "finished_at": time.time()})
