"""The recipe contract and its registry: how a scenario's records and reports become a candidate release. A recipe is
a shipped name (reefd/plugins.py) or a dotted path `pkg.mod:Class`, run inside the daemon (no torch at module level;
its loss runs in the trainer, as the objective its WeightJob names). Knows nothing about engines, the chain or HTTP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from reefd import plugins, schema

if TYPE_CHECKING:
    from reefd.harness import Harness

PRODUCES = ("weights", "harness", "both", "nothing")
TRAINS = ("weights", "both")  # what a recipe that trains weights produces


class RecipeError(ValueError):
    """A recipe that cannot be found, or parameters it refuses. str() is one line."""


@dataclass(frozen=True)
class Sample:
    """One scored rollout, exactly as the engine produced it (token ids and logprobs from the record)."""

    receipt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None]
    reward: float
    group: str  # rollouts of the same prompt share a key (group-relative recipes use it)
    reports: list[str] = field(default_factory=list)
    top_ids: list[list[int]] | None = None  # the engine's top-K ids at each completion token (a recipe captured them)
    extra: dict[str, Any] | None = None  # what the recipe passes its trainer-side objective (JSON)
    context: dict[str, Any] = field(default_factory=dict)  # what else the recipe keeps: messages, text, feedback
    # set by reefd, whatever the recipe sets: the release that served it, how many releases the job's base is
    # ahead of that one (None: not in the chain), and whether it is kept past max_staleness to be weighted
    release: str | None = None
    staleness: int | None = None
    stale: bool = False


@dataclass
class WeightJob:
    """A candidate to train: the trainer spec's recipe-owned part (reefd/train/spec.py has the rest)."""

    kind: ClassVar[str] = "weights"  # its job kind (reefd/grow/job_kinds)
    objective: str  # pkg.mod:Class of the recipe's trainer-side Objective (recipes.sao.objective:SAOObjective)
    samples: list[Sample]
    lora: dict[str, Any]
    optim: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)  # the objective's settings (its Settings dataclass)
    seed: int = 0
    # receipts of records the recipe looked at and found nothing to learn from (a group whose rewards are all
    # equal): consumed with the batch, never trained on
    skipped: list[str] = field(default_factory=list)
    target: str = "lora"  # lora: a LoRA adapter candidate; full: every parameter, a full-weights candidate


@dataclass
class HarnessJob:
    """A harness candidate to propose: reefd sends `messages` to the proposer model and hands its answer to
    `edit`, which turns it into harness mutations (see reefd/harness) or raises RecipeError for a malformed or
    unsafe answer (the candidate is then skipped with that reason, and nothing is published)."""

    kind: ClassVar[str] = "harness"
    messages: list[dict[str, Any]]
    samples: list[Sample]
    edit: Callable[[str, Harness], list[dict[str, Any]]]
    max_tokens: int = 2048
    temperature: float = 0.0
    proposer: dict[str, Any] | None = None  # a `model:` config (engine, source/path/url, ...); None: the scenario's


@dataclass
class Ask:
    """One model answer a search job asks the runner for."""

    messages: list[dict[str, Any]]
    harness: Harness | None = None  # the scenario's engine and release, with this harness in the system prompt
    role: str | None = None  # answered as this role's subagent (Scenario.harness_text with a role)
    reflect: bool = False  # the job's reflection model answers instead (no harness)
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Found:
    """How a search job ends: the archive to keep, and the harness to serve (None: nothing beat the serving one)
    with the mutations that make it from the serving harness, and what the model answered that proposed them
    (kept in the release, shown by `reefctl explain`)."""

    archive: dict[str, Any]
    reason: str  # what happened, one line (the job shows it)
    proposed: Harness | None = None
    mutations: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    proposal: str = ""


@dataclass
class SearchContext:
    """What a search job starts from: its archive (None the first time), the serving harness, and a loader of
    task files (JSONL, relative to the scenarios folder; reefd/commit/gates/tasks.py)."""

    archive: dict[str, Any] | None
    serving: Harness
    tasks: Callable[[str], list[Any]]


Search = Generator[list[Ask], list[str], Found]


@dataclass
class Bundle:
    """A candidate holding an adapter and a harness, made from one batch: `weights` is trained (its target must
    be lora) and `harness` proposed (None: the serving harness is carried unchanged); the pair is gated once,
    against what serves, and released, swapped and rolled back as one release (kind `bundle`). `samples` is the
    batch; reefd trains `weights` on it as the runner marked it (staleness)."""

    kind: ClassVar[str] = "bundle"
    weights: WeightJob
    harness: HarnessJob | None
    samples: list[Sample]


@dataclass
class HarnessSearch:
    """A harness job that needs rounds of model answers (GEPA). `run(ctx)` is a generator: it yields lists of Ask
    and is sent their answers (texts, in order), and returns Found. It stays pure: the runner makes every call.
    The runner keeps `Found.archive` as one JSON file per scenario (STATE/archives/NAME.json, replaced
    atomically), and gates and commits `Found.proposed` as any harness candidate."""

    kind: ClassVar[str] = "search"
    run: Callable[[SearchContext], Search]
    samples: list[Sample]
    reflector: Any = None  # None: the scenario's engine and release; a `model:` config; or pkg.mod:fn(messages)


class Recipe(Protocol):
    """A way of growing a scenario. `Config` is a dataclass (`recipe.params` is validated into it) and reefd builds
    a recipe as `Class(config)`; `produces` says what its candidates are: "weights" (a WeightJob, trained by the
    scenario's trainer backend), "harness" (a HarnessJob, proposed by a model, or a HarnessSearch, rounds of
    answers), "both" (a Bundle: an adapter and a harness in one candidate) or "nothing" (no jobs run). What else
    it asks of reefd, it declares: Unbatched, Ages, CapturesTopK, Judged (below), and a grid of attempts
    (reefd/grow/attempts.py's Search).

    Guarantees reefd gives a recipe: `sample` sees each record with all its reports (oldest first) and is never
    shown a record already consumed by a published or rejected candidate; `candidate` gets the samples in
    receipt order (without those past its max_staleness, with `stale: drop`: they are consumed unseen), and the
    serving harness (or None). Once a job's candidate is published or rejected, every record of its batch is
    consumed (never trained on again) and the release lists their receipts and report ids.
    A recipe's methods are pure: no I/O, no engine calls.
    """

    Config: ClassVar[type]
    produces: ClassVar[str]

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        """Eligibility: the record as a sample, or None when it is not one."""
        ...

    def ready(self, samples: list[Sample]) -> bool:
        """Is a batch ready (count triggers ask this)."""
        ...

    def candidate(self, samples: list[Sample], harness: Harness | None = None
                  ) -> WeightJob | HarnessJob | HarnessSearch | Bundle: ...


# What a recipe declares beyond the contract: its value types live here, so that a recipe imports this module
# and nothing behind it (reefd/grow/staleness.py and reefd/grow/judge.py act on them).


@dataclass(frozen=True)
class Policy:
    """What a recipe does with a sample older than `max_staleness` releases (None: no limit)."""

    max_staleness: int | None = None
    stale: str = "drop"  # drop: consumed, never trained; weight: trained, importance-weighted by its objective


@dataclass
class JudgeSettings:
    """What a recipe asks of reefd's judge (a recipe's `judge` attribute; None: no judging)."""

    model: str | dict[str, Any] | None = None  # None: the scenario's engine; a model config; or "pkg.mod:fn"
    votes: int = 3
    temperature: float = 0.6
    top_p: float = 1.0
    max_tokens: int = 512
    timeout_s: float = 120.0
    hints: bool = True
    max_hints: int = 3
    concurrency: int = 2  # turns judged at once, per scenario
    retry_s: float = 30.0  # a turn whose judge was unreachable is tried again this long after


@runtime_checkable
class Unbatched(Protocol):
    needs_records: bool  # False: a manual or timed job runs with no samples (GEPA's search reads its own tasks)


@runtime_checkable
class Ages(Protocol):
    staleness: Policy  # how old a weight recipe's samples may be (from its params' max_staleness and stale)


@runtime_checkable
class CapturesTopK(Protocol):
    capture_top_k: int  # serving records the engine's top-K token ids at every generated token


@runtime_checkable
class Judged(Protocol):
    judge: JudgeSettings  # reefd's judge (reefd/grow/judge.py) judges each turn from its next state, as a report


@dataclass
class RecordOnlyConfig:
    """The record recipe has no settings."""


class RecordOnly:
    """The default: record every turn, never train."""

    Config = RecordOnlyConfig
    produces = "nothing"

    def __init__(self, cfg: RecordOnlyConfig) -> None:
        self.cfg = cfg

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return None

    def ready(self, samples: list[Sample]) -> bool:
        return False

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        raise RecipeError("the record recipe does not train")


def engine_tokens(record: dict[str, Any]) -> tuple[list[int], list[int], list[Any]] | None:
    """(prompt ids, completion ids, completion logprobs) as the engine consumed and produced them, or None for a
    record a weight recipe cannot train on: an upstream answer, an empty or failed one."""
    ids, logprobs = record.get("completion_token_ids"), record.get("completion_logprobs")
    prompt = record.get("prompt_token_ids")
    if not ids or not prompt or not isinstance(logprobs, list) or len(logprobs) != len(ids):
        return None
    return prompt, ids, logprobs


def scored_rollout(record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
    """The common eligibility rule: a record with engine token ids and logprobs and a numeric score (the
    latest report's score counts). Upstream records (no token ids) and unscored records are not eligible."""
    tokens = engine_tokens(record)
    if tokens is None:
        return None
    prompt, ids, logprobs = tokens
    scores = [r for r in reports if isinstance(r.get("score"), int | float) and not isinstance(r.get("score"), bool)]
    if not scores or not math.isfinite(float(scores[-1]["score"])):
        return None
    group = hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in prompt)).hexdigest()[:16]
    return Sample(receipt=record["id"], prompt_ids=list(prompt), completion_ids=list(ids), logprobs=list(logprobs),
                  reward=float(scores[-1]["score"]), group=group, reports=[r["report_id"] for r in scores])


def check_model_or_function(value: Any, where: str, what: str) -> None:
    """A recipe's model setting: null (the scenario's own engine), a `model:` config, or a dotted path pkg.mod:fn to
    a Python function (`what` names it in errors); RecipeError naming `where` otherwise."""
    from reefd.engines import ModelConfig

    if isinstance(value, str):
        try:
            plugins.resolve({}, value, what)
        except plugins.PluginError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    elif isinstance(value, dict):
        try:
            ModelConfig(**value)
        except TypeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    elif value is not None:
        raise RecipeError(f"{where}: null (the scenario's engine), a model config, or a dotted path pkg.mod:fn")


def resolve(name: str) -> Any:
    """The recipe class for a shipped name or a `pkg.mod:Class` path, checked against the Recipe protocol."""
    try:
        cls = plugins.resolve(plugins.RECIPES, name, "recipe")
    except plugins.PluginError as exc:
        raise RecipeError(str(exc)) from None
    missing = plugins.missing(Recipe, cls)
    if missing:
        raise RecipeError(f"recipe {name!r} has no {missing[0]!r}: see reefd/grow/recipes.py for the contract")
    if not dataclasses.is_dataclass(cls.Config):
        raise RecipeError(f"recipe {name!r}: its Config must be a dataclass")
    if cls.produces not in PRODUCES:
        raise RecipeError(f"recipe {name!r}: produces is {cls.produces!r}, not one of {', '.join(PRODUCES)}")
    return cls


def build(name: str, params: dict[str, Any]) -> Recipe:
    """An instance of the recipe, its `params` validated against its Config (errors name `recipe.params.KEY`)."""
    cls = resolve(name)
    try:
        cfg = schema.parse(cls.Config, params, "recipe.params")
    except schema.SchemaError as exc:
        raise RecipeError(str(exc)) from None
    recipe: Recipe = cls(cfg)
    return recipe
