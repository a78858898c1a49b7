"""Engines: the data plane behind a scenario. `model.engine` names one (reefd/plugins.py keeps the names), and
`ModelConfig` is its configuration, the `model:` group of a scenario.

An engine turns a ChatRequest into text deltas and a final Completion. Knows nothing about
provider wire formats or records.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from reefd import plugins
from reefd.serve.chat import ChatRequest, Completion

MODEL_SOURCES = ["tiny", "smollm2"]
ANY_WEIGHTS = "*"
"""`generate(weights=...)` default: whatever weights serve new requests now. A binding passes its own version
instead (a release id; None: the weights the engine was launched with), so an answer never comes from others."""
TOOL_PARSERS = ["hermes"]


@dataclass
class ModelConfig:
    """Which model answers a scenario, and which engine runs it."""

    name: str = field(default="", metadata={"description": "Display name of the model."})
    engine: str = field(
        default="worker",
        metadata=plugins.name_schema(plugins.ENGINES, "worker: the embedded engine process; sglang: a real SGLang "
                                     "server (launched, or attached by url); upstream: an OpenAI-compatible "
                                     "provider; or pkg.mod:Class, an Engine of your own."),
    )
    source: str | None = field(
        default=None,
        metadata={"enum": [*MODEL_SOURCES, None],
                  "description": "A built-in model that reefd prepares into STATE/models/<source>."},
    )
    path: str | None = field(
        default=None, metadata={"description": "An HF model folder (overrides source)."}
    )
    url: str | None = field(
        default=None,
        metadata={"description": "sglang: attach to this server instead of launching one. "
                  "upstream: the provider's base URL, e.g. https://api.openai.com/v1."},
    )
    api_key_env: str | None = field(
        default=None, metadata={"description": "upstream: environment variable holding the key."}
    )
    upstream_model: str | None = field(
        default=None, metadata={"description": "upstream: the model name sent to the provider."}
    )
    tool_parser: str = field(
        default="hermes",
        metadata={"enum": TOOL_PARSERS, "description": "How tool calls appear in model output."},
    )
    max_batch: int = field(
        default=8, metadata={"minimum": 1, "description": "Engine batch size (worker)."}
    )
    max_new_tokens: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Caps generation whatever max_tokens a client asks "
                                               "for; the answer then ends with a length stop."}
    )
    context_length: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Prompt plus answer, in tokens (default: the model "
                                               "folder's max_position_embeddings)."}
    )
    launch_args: list[str] = field(
        default_factory=list,
        metadata={"description": "Extra command-line arguments for a launched engine."},
    )
    startup_timeout_s: float = field(
        default=600.0, metadata={"exclusiveMinimum": 0, "description": "Engine start deadline."}
    )
    replicas: int = field(
        default=1, metadata={"minimum": 1, "description": "worker/sglang: engine processes reefd launches. More "
                                                         "than one puts sglang-router in front of them."})
    workers: list[str] = field(
        default_factory=list,
        metadata={"description": "worker/sglang: URLs of engines already running (other machines), served behind "
                                 "the same router as the launched replicas."})
    router_args: list[str] = field(
        default_factory=list, metadata={"description": "Extra command-line arguments for sglang-router."})
    max_queue: int | None = field(
        default=None,
        metadata={"minimum": 0, "description": "Requests that may wait for a turn beyond the ones generating "
                  "(max_batch per replica); past that a request gets 429 at once. Default: 4 x the engine's batch "
                  "for worker and sglang, no limit for other engines (set it to give them one, of max_batch turns)."})
    max_queue_wait_s: float = field(
        default=60.0,
        metadata={"exclusiveMinimum": 0, "description": "The longest a request waits for its turn; then it gets "
                  "503 with Retry-After."})




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

    def __init__(self, prompt_tokens: int, limit: int, at_least: bool = False):
        counted = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(f"prompt is too long: {counted} tokens > {limit} maximum (this "
                         f"model's maximum context length is {limit} tokens)", status=400)


class Engine(Protocol):
    """What a scenario needs from its engine; reefd builds one as `Class(model_config, state_dir, http_session)`
    for each distinct `model:` config, and scenarios with equal configs share it.

    `adapter` names a LoRA adapter loaded with `load_adapter` (None: the base model); `adapters` maps the
    names loaded now to their folders.

    `generate` may first yield a Prompt, then yields str text deltas (tool-call markup already held back) and ends with
    exactly one Completion; it raises EngineUnavailable before yielding anything when the
    engine is not ready. `start` returns promptly (start-up continues in the background);
    `stop` ends anything the engine launched. `describe` is for status pages.

    Engines that serve full-weight releases also have `swap_weights` and `admit` (see SGLangEngine), and take
    `weights=` in `generate`; the reconciler refuses weights releases on engines without them.
    """

    kind: str
    adapters: Mapping[str, Path]

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


def engine_class(name: str) -> Any:
    """The engine class `model.engine` names (PluginError when it cannot be found or is not an Engine)."""
    cls = plugins.resolve(plugins.ENGINES, name, "engine")
    missing = plugins.missing(Engine, cls, instance_attrs=("kind", "adapters", "ready"))
    if missing:
        raise plugins.PluginError(f"engine {name!r} is not an Engine (no {', '.join(missing)}); see reefd/engines")
    return cls


BATCHED_ENGINES = ("worker", "sglang")


def turn_limits(cfg: ModelConfig) -> tuple[int, int] | None:
    """(requests generating at once, requests waiting) for the engine `cfg` describes; None: no admission limit."""
    if cfg.engine in BATCHED_ENGINES:
        turns = cfg.max_batch * (cfg.replicas + len(cfg.workers))
        return turns, 4 * turns if cfg.max_queue is None else cfg.max_queue
    if cfg.max_queue is not None:
        return cfg.max_batch, cfg.max_queue
    return None


def build_engine(cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession) -> Engine:
    """The engine for a `model:` config."""
    engine: Engine = engine_class(cfg.engine)(cfg, state_dir, session)
    return engine
