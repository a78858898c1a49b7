"""Validation of generation requests: SGLang `/generate` bodies into typed, checked params.

Owns the request vocabulary (sampling params, logprob options) and its error messages.
Knows nothing about torch, tokenizers or HTTP; a bad field raises `BadRequest`.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

# `--fault` (or `--fault-file`), for tests of what reefd does with a process that says success and serves something
# else: adapter loads that serve the base model, a damaged tensor, the previous adapter, one decoder layer's LoRA
# 1.1 times too strong, or every logprob of the adapter's answers reported SHIFT_NATS off; weight updates that
# change nothing.
FAULTS = ("empty-adapters", "corrupt-adapters", "stale-adapters", "scaled-layer", "shift-logprobs", "ignore-weights")
SHIFT_NATS = -0.055  # shift-logprobs: just past the release proof's default tolerance (0.05 nats)

TOP_LOGPROBS_MAX = 20  # the most alternatives `top_logprobs_num` may ask for per token (as OpenAI's cap)


class BadRequest(ValueError):
    """A request the worker refuses; its message goes back to the client as a 400."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; logprobs are always those of the unmodified model distribution."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy (argmax of the raw logits)
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """True when top-k, top-p or min-p actually cut the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class GenerateRequest:
    """One `/generate` call: exactly one of `input_ids` / `text` is set before tokenization."""

    input_ids: list[int] | None
    text: str | None
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # alternatives per output token; 0 unless return_logprob (SGLang returns none then)
    stream: bool = False
    lora_path: str | None = None  # a loaded LoRA adapter's name (SGLang's field); None = the base model
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)


# SGLang sampling keys we accept only at their neutral value (anything else is refused, not ignored).
_NEUTRAL = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "sampling_seed",
    "seed"}


def _number(d: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"sampling_params.{key} must be a number")
    if not lo <= value <= hi:
        raise BadRequest(f"sampling_params.{key} must be in [{lo}, {hi}], got {value}")
    return float(value)


def _integer(d: dict[str, Any], key: str, default: int | None, lo: int) -> int | None:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"sampling_params.{key} must be an integer")
    if value < lo:
        raise BadRequest(f"sampling_params.{key} must be >= {lo}, got {value}")
    return value


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{what} must be a list of integers")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("sampling_params.stop must be a non-empty string or a list of them")
    return tuple(value)


def parse_sampling(d: Any, default_max_new_tokens: int = 128) -> SamplingParams:
    """Check an SGLang `sampling_params` dict (`seed` is accepted for `sampling_seed`)."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise BadRequest("sampling_params must be an object")
    for key, value in d.items():
        if key in _NEUTRAL:
            if value is not None and value != _NEUTRAL[key]:
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by this worker")
        elif key not in _SAMPLING_KEYS:
            raise BadRequest(f"unknown sampling parameter {key!r}")
    top_k = _integer(d, "top_k", -1, -1)
    seed = d.get("sampling_seed", d.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("sampling_params.sampling_seed must be an integer")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("sampling_params.ignore_eos must be a boolean")
    return SamplingParams(
        max_new_tokens=int(_integer(d, "max_new_tokens", default_max_new_tokens, 0) or 0),
        temperature=_number(d, "temperature", 1.0, 0.0, 100.0), top_p=_number(d, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k in (None, 0) else int(top_k), min_p=_number(d, "min_p", 0.0, 0.0, 1.0),
        stop=_stop_strings(d.get("stop")),
        stop_token_ids=tuple(_token_ids(d.get("stop_token_ids") or [], "sampling_params.stop_token_ids")),
        ignore_eos=ignore_eos, seed=None if seed is None else int(seed) % (2**63))


def parse_generate(body: Any) -> GenerateRequest:
    """Check a `/generate` body (single request; batched lists are refused)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequest("give exactly one of input_ids or text")
    if input_ids is not None:
        input_ids = _token_ids(input_ids, "input_ids")
        if not input_ids:
            raise BadRequest("input_ids must not be empty")
    elif not isinstance(text, str) or not text:
        raise BadRequest("text must be a non-empty string (batched lists are not supported)")
    return_logprob = body.get("return_logprob", False)
    stream = body.get("stream", False)
    if not isinstance(return_logprob, bool) or not isinstance(stream, bool):
        raise BadRequest("return_logprob and stream must be booleans")
    start = body.get("logprob_start_len", -1)
    if start is None:
        start = -1
    if isinstance(start, bool) or not isinstance(start, int) or start < -1:
        raise BadRequest("logprob_start_len must be an integer >= -1")
    top_n = body.get("top_logprobs_num", 0)
    if top_n is None:
        top_n = 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= TOP_LOGPROBS_MAX:
        raise BadRequest(f"top_logprobs_num must be an integer in [0, {TOP_LOGPROBS_MAX}], got {top_n!r}")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    lora_path = body.get("lora_path")
    if lora_path is not None and not isinstance(lora_path, str):
        raise BadRequest("lora_path must be the name of a loaded adapter (batched lists are not supported)")
    req = GenerateRequest(
        lora_path=lora_path or None, input_ids=input_ids, text=text,
        sampling=parse_sampling(body.get("sampling_params")), return_logprob=return_logprob, logprob_start_len=start,
        top_logprobs_num=top_n if return_logprob else 0, stream=stream)
    if rid:
        req.rid = rid
    return req
