"""The engine kinds' configs: the `model:` keys every kind shares, each shipped kind's own keys, rules and declared
facts, and ModelConfig, their union (the flat `model:` mapping Hydra composes). Knows nothing about processes or
HTTP, nor which engine class reads a config (reefd/engines/__init__.py maps kinds to classes)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import ClassVar

from reefd import plugins

MODEL_SOURCES = ["tiny", "smollm2"]
TOOL_PARSERS = ["hermes"]
ENGINE_MODULES = ("torch", "transformers", "peft")  # what the worker process imports: the `engine` extra
Problems = list[tuple[str, str]]
"""(key path, one-line message) for each problem of a `model:` config."""


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


MAX_TOKENS = 1 << 24  # a prompt, an answer or a context, in tokens
MAX_REPLICAS = 64  # engine processes behind one router, launched or attached
DAY_S = 86400.0

@dataclass
class EngineConfig:
    """The keys every engine kind has. A kind's own config adds its keys and `problems`, and declares facts about
    its engine as class attributes; an engine of your own without a `Config` gets this one."""

    seeded_sampling: ClassVar[bool] = False  # a request's sampling follows its seed: a re-run gives the same answer
    batched: ClassVar[bool] = False  # generates max_batch requests at once per process: its admission line's turns
    remote: ClassVar[bool] = False  # the model runs at a provider: no model folder, no adapters or weights

    name: str = field(default="", metadata={"description": "Display name of the model."})
    engine: str = field(default="worker", metadata=plugins.name_schema(
        plugins.ENGINES, "worker: the embedded engine process; sglang: a real SGLang server (launched, or attached "
        "by url); upstream: an OpenAI-compatible provider; or pkg.mod:Class, an Engine of your own."))
    tool_parser: str = field(
        default="hermes", metadata={"enum": TOOL_PARSERS, "description": "How tool calls appear in model output."})
    max_batch: int = field(default=8, metadata={"minimum": 1, "maximum": 1024,
                                                "description": "Engine batch size (worker)."})
    max_new_tokens: int | None = field(
        default=None, metadata={"minimum": 1, "maximum": MAX_TOKENS,
                                "description": "Caps generation whatever max_tokens a client asks for; the answer "
                                               "then ends with a length stop."})
    startup_timeout_s: float = field(
        default=600.0, metadata={"exclusiveMinimum": 0, "maximum": DAY_S, "description": "Engine start deadline."})
    max_queue: int | None = field(
        default=None,
        metadata={"minimum": 0, "maximum": 100_000,
                  "description": "Requests that may wait for a turn beyond the ones generating (max_batch per "
                                 "replica); past that a request gets 429 at once. Default: 4 x the engine's batch for "
                                 "worker and sglang, no limit for other engines (set it to give them one, of "
                                 "max_batch turns)."})
    max_queue_wait_s: float = field(
        default=60.0,
        metadata={"exclusiveMinimum": 0, "maximum": 3600,
                  "description": "The longest a request waits for its turn; then it gets 503 with Retry-After."})

    def problems(self) -> Problems:
        """What is wrong with this kind's keys; the cross-kind rules are reefd.engines.check's."""
        return []


@dataclass
class UpstreamConfig(EngineConfig):
    """upstream: an OpenAI-compatible provider, passed through."""

    remote: ClassVar[bool] = True

    url: str | None = field(
        default=None, metadata={"description": "The provider's base URL, e.g. https://api.openai.com/v1."})
    api_key_env: str | None = field(default=None, metadata={"description": "Environment variable holding the key."})
    upstream_model: str | None = field(default=None, metadata={"description": "The model name sent to the provider."})

    def problems(self) -> Problems:
        return [] if self.url else [("model.url", "an upstream model needs its provider's base URL")]


@dataclass
class WorkerConfig(EngineConfig):
    """worker: the embedded engine process (reefd.worker), launched by reefd; its sampling follows each request's
    seed."""

    seeded_sampling: ClassVar[bool] = True
    batched: ClassVar[bool] = True

    source: str | None = field(
        default=None, metadata={"enum": [*MODEL_SOURCES, None],
                                "description": "A built-in model that reefd prepares into STATE/models/<source>."})
    path: str | None = field(default=None, metadata={"description": "An HF model folder (overrides source)."})
    context_length: int | None = field(
        default=None, metadata={"minimum": 1, "maximum": MAX_TOKENS,
                                "description": "Prompt plus answer, in tokens (default: the model folder's "
                                               "max_position_embeddings)."})
    launch_args: list[str] = field(
        default_factory=list, metadata={"description": "Extra command-line arguments for a launched engine."})
    replicas: int = field(
        default=1, metadata={"minimum": 1, "maximum": MAX_REPLICAS,
                             "description": "Engine processes reefd launches. More than one puts sglang-router in "
                                            "front of them."})
    workers: list[str] = field(
        default_factory=list,
        metadata={"maxItems": MAX_REPLICAS,
                  "description": "URLs of engines already running (other machines), served behind the same router "
                                 "as the launched replicas."})
    router_args: list[str] = field(
        default_factory=list, metadata={"description": "Extra command-line arguments for sglang-router."})

    def problems(self) -> Problems:
        errs = [] if self.source or self.path else [("model", "a worker model needs 'source' or 'path'")]
        errs += self.replica_problems()
        missing = [m for m in ENGINE_MODULES if not installed(m)]
        if missing:  # checked at load rather than met as a worker's traceback
            errs.append(("model.engine", f"worker runs the model with {', '.join(missing)}, not installed here: "
                                         "pip install 'reefd[engine]'"))
        return errs

    def replica_problems(self) -> Problems:
        if (self.replicas > 1 or self.workers) and not installed("sglang_router"):
            key = "model.replicas" if self.replicas > 1 else "model.workers"
            return [(key, "replicas run behind sglang-router, which is not installed: pip install 'reefd[scale]'")]
        return []


@dataclass
class SGLangConfig(WorkerConfig):
    """sglang: a real SGLang server, launched by reefd or attached by url."""

    seeded_sampling: ClassVar[bool] = False

    url: str | None = field(default=None, metadata={"description": "Attach to this server instead of launching one."})

    def problems(self) -> Problems:
        errs = [] if self.url or self.source or self.path else \
            [("model", "an sglang model needs 'url' to attach to, or 'source'/'path'")]
        router = self.replica_problems()
        if not router and self.url and (self.replicas > 1 or self.workers):
            router = [("model.url", "with replicas, list engines already running in model.workers")]
        return errs + router


LORA_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]  # vLLM's --max-lora-rank choices
VLLM_PYTHON_ENV = "REEF_VLLM_PYTHON"


@dataclass
class VLLMConfig(SGLangConfig):
    """vllm: vLLM's OpenAI server, launched by reefd from its own Python environment, or attached by url; its
    sampling follows each request's seed (per-request generators), in any batch."""

    seeded_sampling: ClassVar[bool] = True

    python: str | None = field(
        default=None, metadata={"description": "vllm: the Python of vLLM's own environment, which reefd launches "
                                               "the server with (default: $REEF_VLLM_PYTHON; `make vllm-venv` "
                                               "builds one)."})
    kv_cache_gib: float = field(
        default=2.0, metadata={"exclusiveMinimum": 0, "maximum": 4096,
                               "description": "vllm on CPU: the KV cache's size, in GiB (VLLM_CPU_KVCACHE_SPACE)."})
    max_loras: int = field(
        default=4, metadata={"minimum": 2, "maximum": 256,
                             "description": "vllm: adapters in one batch (a serving one beside a candidate's)."})
    max_lora_rank: int = field(
        default=16, metadata={"enum": LORA_RANKS, "description": "vllm: the largest adapter rank it loads."})
    dtype: str = field(
        default="float32", metadata={"enum": ["auto", "float32", "bfloat16", "float16"],
                                     "description": "vllm: the weights' type. float32 computes as the worker and "
                                                    "the release proof's reference do; bfloat16 halves memory on a "
                                                    "GPU (auto: vLLM's choice for the model folder)."})
    enforce_eager: bool = field(
        default=True, metadata={"description": "vllm: no CUDA graphs or torch.compile: starts in about a minute "
                                               "rather than four (on CPU with LoRA vLLM compiles nothing anyway)."})

    def launcher(self) -> str | None:
        """The Python reefd launches vLLM with."""
        return self.python or os.environ.get(VLLM_PYTHON_ENV) or None

    def problems(self) -> Problems:
        errs = [] if self.url or self.source or self.path else \
            [("model", "a vllm model needs 'url' to attach to, or 'source'/'path'")]
        python = self.launcher()
        if not self.url and python is None:
            errs.append(("model.python", f"vllm runs in its own Python environment: set model.python (or "
                                         f"${VLLM_PYTHON_ENV}) to its interpreter; `make vllm-venv` builds one"))
        elif not self.url and python is not None and not os.access(python, os.X_OK):
            errs.append(("model.python", f"{python} is not an executable Python (vLLM's environment): "
                                         "`make vllm-venv` builds one"))
        router = self.replica_problems()
        if not router and self.url and (self.replicas > 1 or self.workers):
            router = [("model.url", "with replicas, list engines already running in model.workers")]
        return errs + router


@dataclass
class ModelConfig(VLLMConfig, UpstreamConfig):
    """Which model answers a scenario, and which engine runs it: every kind's keys (each kind reads its own)."""

    url: str | None = field(default=None, metadata={"description": "sglang: attach to this server instead of "
                            "launching one. upstream: the provider's base URL, e.g. https://api.openai.com/v1."})
