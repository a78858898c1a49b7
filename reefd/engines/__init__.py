"""Engines: the data plane behind a scenario, and the registry that maps `model.engine` to one.

An engine turns a ChatRequest into text deltas and a final Completion. Knows nothing about
provider wire formats or records.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from reefd.chat import ChatRequest, Completion
from reefd.config import ModelConfig


@dataclass
class Prompt:
    """An optional first stream event: the engine knows the prompt's length in tokens."""

    tokens: int


class EngineUnavailable(Exception):
    """The engine cannot take requests right now (starting, restarting). Retry later."""

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after(value: str | None, default: int = 5) -> int:
    """A Retry-After header in whole seconds (it may be a number or an HTTP date)."""
    try:
        return max(1, round(float(value or default)))
    except ValueError:
        return default


class EngineError(Exception):
    """The engine failed this request. `status` is the HTTP status to answer with."""

    code = "engine_error"
    param: str | None = None

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class ContextLengthExceeded(EngineError):
    """The prompt alone does not fit the model's context: the client must shorten it."""

    code = "context_length_exceeded"
    param = "messages"

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {limit} maximum (this "
                         f"model's maximum context length is {limit} tokens)", status=400)


class Engine(Protocol):
    """What a scenario needs from its engine.

    `adapter` names a LoRA adapter loaded with `load_adapter` (None: the base model).

    `generate` may first yield a Prompt, then yields str text deltas (tool-call markup already held back) and ends with
    exactly one Completion; it raises EngineUnavailable before yielding anything when the
    engine is not ready. `start` returns promptly (start-up continues in the background);
    `stop` ends anything the engine launched. `describe` is for status pages.
    """

    kind: str

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, req: ChatRequest, *, stream: bool = True, timeout_s: float = 600.0,
                 adapter: str | None = None) -> AsyncIterator[Prompt | str | Completion]: ...

    async def load_adapter(self, name: str, path: Path) -> None:
        """Load a LoRA adapter folder under `name` (EngineError if the engine cannot or will not).

        The engine keeps it loaded across its own restarts until `unload_adapter`."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload `name`; requests using it that the engine already has finish first."""
        ...

    def count_tokens(self, req: ChatRequest) -> int: ...

    def describe(self) -> dict[str, Any]: ...

    def model_folder(self) -> Path | None:
        """The local model folder once known (after preparation); None for remote models."""
        ...


def build_engine(cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession) -> Engine:
    """The registry: `model.engine` in YAML → engine class."""
    from reefd.engines.sglang import SGLangEngine
    from reefd.engines.upstream import UpstreamEngine

    if cfg.engine == "upstream":
        return UpstreamEngine(cfg, session)
    if cfg.engine in ("worker", "sglang"):
        return SGLangEngine(cfg, state_dir, session)
    raise ValueError(f"unknown engine {cfg.engine!r}")
