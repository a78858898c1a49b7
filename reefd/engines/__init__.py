"""Engines, the data plane behind a scenario: an Engine turns a ChatRequest into text deltas and a Completion;
`model.engine` names its kind, whose `Config` (kind_configs.py) holds its keys, and optional abilities are the
Protocols below. Knows nothing about provider wire formats or records."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp

from reefd import plugins, schema
from reefd.engines.kind_configs import EngineConfig, ModelConfig, Problems
from reefd.serve.chat import ChatRequest, Completion

ANY_WEIGHTS = "*"
"""`generate(weights=...)` default: whatever weights serve new requests now. A binding passes its own version
instead (a release id; None: the weights the engine was launched with), so an answer never comes from others."""


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
    `stop` ends anything the engine launched. `describe` is for status pages. Optional abilities: WeightSwap,
    Admits, Replicated, SamplesTokens; what a kind's config declares: EngineConfig's class attributes.
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


@dataclass(frozen=True)
class Weights:
    """The weights an engine serves to new requests."""

    version: str | None = None  # the release id they were swapped in as (None: the weights it launched with)
    path: Path | None = None  # their folder (None: the model folder it launched with)


def ties_embeddings(folder: Path) -> bool:
    """The model folder's config ties its output layer to its input embeddings (`tie_word_embeddings`)."""
    try:
        return bool(json.loads((folder / "config.json").read_bytes()).get("tie_word_embeddings", False))
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class SwapLimits:
    """The full weights a WeightSwap engine cannot swap to in place, as its kind declares them (`swap_limits`):
    each field is the reason a kind of model folder is refused, naming the fix (None: such weights are taken).

    Read with the scenario's engine and asked (`refusal`) before a weights release is written to the chain (a
    publish, a Grow job before it trains) and again before a swap touches a process, so a release the engine
    cannot serve is never committed and a refused swap leaves the serving weights alone. A weights release keeps
    its base model's config (reefd/commit/weights.py), so the base model's folder answers for any of them."""

    tied_embeddings: str | None = None  # a model whose output layer is its input embeddings

    def refusal(self, folder: Path) -> str | None:
        """Why the weights in model folder `folder` cannot be swapped in (None: they can); reads its config.json."""
        if self.tied_embeddings is not None and ties_embeddings(folder):
            return self.tied_embeddings
        return None

    def refuse(self, folder: Path | None, version: str) -> None:
        """EngineError (400) for weights `refusal` refuses, raised by a swap to `version` before it touches any
        process: the weights serving stay, and nothing restarts. None: no folder known yet (nothing to swap)."""
        if folder is not None and (why := self.refusal(folder)) is not None:
            raise EngineError(f"{version}: {why}", status=400)


Drained = Callable[[str | None], Awaitable[None]]
"""drained(version): returns once no request taken on that weight version is in flight (reefd's own count)."""


@runtime_checkable
class WeightSwap(Protocol):
    """An engine that serves full-weight releases: `weights` is what new requests get, and `generate` takes
    `weights=` (a version; ANY_WEIGHTS: whatever serves), answering only from those. The reconciler refuses
    weights releases on other engines.

    `swap_weights(path, version, adapter, switch, drained)` serves the weights at `path` (None: the launch
    model's) as `version`, with `adapter` (name, folder) as their only adapter; it calls `switch()` the moment
    new requests get them and `drained(old version)` to wait out the old ones. A failure leaves the old weights
    serving and raises; weights its `swap_limits` refuse raise EngineError before any process is touched. Returns
    what the swap measured."""

    weights: Weights
    swap_limits: SwapLimits

    async def swap_weights(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                           switch: Callable[[], None], drained: Drained) -> dict[str, Any]: ...


@runtime_checkable
class WeightTrial(WeightSwap, Protocol):
    """A WeightSwap engine of several replicas that can put full weights on trial beside those that serve: a group
    of its replicas (`staged`, what they serve) leaves the router and serves only requests that ask for the staged
    version by `generate(weights=...)`; the router keeps serving `weights`. Guarantees:
    - `stage_weights(path, version, adapter, share, drained)` takes share × the serving replicas (at least one, at
      most all but one) out of the router one at a time, each drained, loaded and proven; weights staged before
      are ended first (their requests drained). Fewer than two serving replicas, or a failure: nothing stays
      staged, the replicas are put back, and it raises.
    - `swap_weights` to the staged version (their promotion) returns the group to the router and swaps the rest
      as a rolling swap does, reloading nothing in the group; to any other weights it swaps the replicas in the
      router only (the caller ends the stage after).
    - `end_staged(drained)` (when nothing is on trial any more) waits out the requests on the staged version, then
      puts the group back on `weights` and into the router; nothing when nothing is staged.
    `trial_replicas` is how many replicas it runs: a trial needs two or more."""

    staged: Weights | None

    @property
    def trial_replicas(self) -> int: ...

    async def stage_weights(self, path: Path | None, version: str, adapter: tuple[str, Path] | None, share: float,
                            drained: Drained) -> dict[str, Any]: ...

    async def end_staged(self, drained: Drained) -> dict[str, Any] | None: ...


def trial_replicas(engine: Engine) -> int:
    """The replicas full weights may go on trial across on `engine` (a WeightTrial's; 1 for any other engine): a
    trial of weights needs two or more."""
    return engine.trial_replicas if isinstance(engine, WeightTrial) else 1


@runtime_checkable
class Proves(Protocol):
    """An engine whose every process proves a release after each load or swap, before it takes traffic: `proofs`
    maps (weight version, adapter name; None: the weights alone) to the answers a process serving them must give
    (reefd/engines/proof.py). A process that answers otherwise does not serve them (the load or swap fails)."""

    proofs: dict[tuple[str | None, str | None], Any]


@runtime_checkable
class Admits(Protocol):
    """An engine that may hold new requests for a while (loading new weights): `admit` returns when one may
    start."""

    async def admit(self) -> None: ...


@runtime_checkable
class Replicated(Protocol):
    """An engine that may run several replicas: `replica_status` describes each (None: it runs one process)."""

    async def replica_status(self) -> list[dict[str, Any]] | None: ...


@dataclass(frozen=True)
class TokenSample:
    """What SamplesTokens samples: `n` answers of at most `max_tokens` to `prompt`, the engine's own token ids.
    temperature 0 is greedy; top_p 1 and top_k None (or -1) cut nothing; with a `seed` the samples repeat (sample
    i draws from seed + i). `stop` None ends a sample at the end of text only; a list of strings or of token ids
    ends it there too; [] never (not even at the end of text). `prompt_logprobs` asks each prompt position's
    logprob; `adapter` is a loaded LoRA adapter's name (None: the base weights)."""

    prompt: Sequence[int]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] | Sequence[int] | None = None
    prompt_logprobs: bool = False
    adapter: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [s for s in self.stop or () if isinstance(s, str)]

    @property
    def stop_ids(self) -> list[int]:
        return [t for t in self.stop or () if not isinstance(t, str)]

    @property
    def ignore_eos(self) -> bool:
        """`stop` is []: not even the end of text ends a sample."""
        return self.stop is not None and len(self.stop) == 0

    def check(self) -> None:
        """EngineError (400) for a request no engine can take."""
        def ints(values: Sequence[object]) -> bool:
            return all(isinstance(v, int) and not isinstance(v, bool) for v in values)

        problem = None
        if not self.prompt or not ints(self.prompt):
            problem = "prompt must be a non-empty list of token ids"
        elif self.n < 1 or self.max_tokens < 1:
            problem = f"n ({self.n}) and max_tokens ({self.max_tokens}) must be at least 1"
        elif self.temperature < 0 or not 0 < self.top_p <= 1 or (self.top_k is not None and self.top_k < -1):
            problem = "temperature must be >= 0, top_p in (0, 1], top_k -1 or more"
        elif self.stop is not None and not (all(isinstance(s, str) and s for s in self.stop) or ints(self.stop)):
            problem = "stop must be a list of non-empty strings or a list of token ids"
        if problem is not None:
            raise EngineError(problem, status=400)


@dataclass(frozen=True)
class SampledSequence:
    """One sample: the ids the engine generated (no prompt), one logprob each, and whether a stop (a stop string
    or id, the end of text) ended it (False: max_tokens or the context length did)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


@dataclass(frozen=True)
class TokenSamples:
    """SamplesTokens' answer: the request's n samples, and with `prompt_logprobs` one logprob per prompt position
    (position 0, which nothing predicts, None)."""

    samples: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@runtime_checkable
class SamplesTokens(Protocol):
    """An engine that samples from a prompt of its own token ids (the Tinker API's `sample`): `sample_tokens`
    answers req.n samples, each with one logprob per generated id under the distribution the engine reports (the
    worker's and vLLM's: the model's own, before temperature, top-k and top-p), the ids the engine's own, never
    text tokenized again. It waits while the engine admits no new requests, and samples on one process serving the
    weights that serve new requests. EngineUnavailable while the engine is not ready; EngineError 400 for a
    request it refuses (an adapter that is not loaded, a token id outside the vocabulary, a prompt that leaves no
    room in the context); a sample may end early, unstopped, at the context length."""

    async def sample_tokens(self, req: TokenSample, *, timeout_s: float = 600.0) -> TokenSamples: ...


def engine_class(name: str) -> Any:
    """The engine class `model.engine` names (PluginError when it cannot be found or is not an Engine)."""
    cls = plugins.resolve(plugins.ENGINES, name, "engine")
    missing = plugins.missing(Engine, cls, instance_attrs=("kind", "adapters", "ready"))
    if missing:
        raise plugins.PluginError(f"engine {name!r} is not an Engine (no {', '.join(missing)}); see reefd/engines")
    return cls


@runtime_checkable
class Configured(Protocol):
    """An engine class that declares its kind's config (the shipped kinds do): `Config`, an EngineConfig with the
    kind's own keys, rules and facts. An engine of your own without one gets EngineConfig."""

    Config: type[EngineConfig]


def kind_config(name: str) -> type[EngineConfig]:
    """The config class of the engine kind `model.engine` names."""
    cls = engine_class(name)
    return cls.Config if isinstance(cls, Configured) else EngineConfig


def check(model: dict[str, Any]) -> Problems:
    """The problems of a composed `model:` mapping: its engine's name, its kind's rules, keys of other kinds."""
    try:
        kind = kind_config(model["engine"])
    except plugins.PluginError as exc:
        return [("model.engine", str(exc))]
    keys = {f.name for f in fields(kind)}
    errs = kind(**{k: v for k, v in model.items() if k in keys}).problems()
    if (model["replicas"] > 1 or model["workers"]) and "replicas" not in keys:
        errs.append(("model.replicas" if model["replicas"] > 1 else "model.workers",
                     f"replicas run behind sglang-router: engine worker or sglang, not {model['engine']!r}"))
    return errs


def json_schema() -> dict[str, Any]:
    """The `model:` mapping's JSON Schema for editors: every key, then the keys each shipped kind reads (the
    others' keys are still allowed: a model group may set them)."""
    out = schema.dataclass_schema(ModelConfig)
    kinds = {name: schema.dataclass_schema(kind_config(name)) for name in plugins.ENGINES}
    out["allOf"] = [{"if": {"properties": {"engine": {"const": name}}, "required": ["engine"]},
                     "then": {"description": sub["description"], "properties": sub["properties"]}}
                    for name, sub in kinds.items()]
    return out


def seeded_sampling(cfg: ModelConfig) -> bool:
    """The engine `cfg` names samples each request by its seed, so a re-run reproduces an answer."""
    return kind_config(cfg.engine).seeded_sampling


def turn_limits(cfg: ModelConfig) -> tuple[int, int] | None:
    """(requests generating at once, requests waiting) for the engine `cfg` describes; None: no admission limit."""
    if kind_config(cfg.engine).batched:
        turns = cfg.max_batch * (cfg.replicas + len(cfg.workers))
        return turns, 4 * turns if cfg.max_queue is None else cfg.max_queue
    if cfg.max_queue is not None:
        return cfg.max_batch, cfg.max_queue
    return None


def build_engine(cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession) -> Engine:
    """The engine for a `model:` config."""
    engine: Engine = engine_class(cfg.engine)(cfg, state_dir, session)
    return engine
