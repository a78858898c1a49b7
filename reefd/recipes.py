"""The recipe contract and the registry: how a scenario's records and reports become a candidate release.

A recipe is a class named in the scenario's `recipe:` group, by a shipped name (`record`, `sao`,
`grpo`) or by dotted path (`pkg.mod:Class`). reefd runs it inside the daemon (so it must not
import torch at module level); weight candidates are trained by a separate trainer process.

    class MyRecipe:
        Config = MyConfig                  # a dataclass: `recipe.params` is validated into it
        trains = True                      # False: the recipe only records (no jobs run)
        def __init__(self, cfg: MyConfig) -> None: ...
        def sample(self, record, reports) -> Sample | None      # eligibility: a scored rollout, or None
        def ready(self, samples: list[Sample]) -> bool           # is a batch ready (count triggers ask this)
        def candidate(self, samples, harness) -> WeightJob      # the batch -> a trainer job spec, or
                                                                # -> HarnessJob for a harness recipe, which also has
        def edit(self, answer, harness) -> list[mutation]       # the proposer's answer -> harness mutations

Guarantees reefd gives a recipe: `sample` sees each record with all its reports (oldest first) and
is never shown a record already consumed by a published or rejected candidate; `candidate` gets
the samples in receipt order. Once a job's candidate is published or rejected, every record of
its batch is consumed (never trained on again) and the release lists their receipts and report
ids for lineage. A recipe's methods are pure: no I/O, no engine calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import jsonschema

from reefd.config import dataclass_schema

if TYPE_CHECKING:
    from reefd.harness import Harness

SHIPPED = {
    "record": "reefd.recipes:RecordOnly",
    "sao": "recipes.sao.recipe:SAO",
    "grpo": "recipes.sao.recipe:GRPO",
    "skillclaw": "recipes.skillclaw.recipe:SkillClaw",
}


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
    context: dict[str, Any] = field(default_factory=dict)  # what else the recipe keeps: messages, text, feedback


@dataclass
class HarnessJob:
    """A harness candidate to propose: reefd sends `messages` to the proposer model and gives its answer to the
    recipe's `edit`, which turns it into harness mutations (see reefd/harness.py)."""

    messages: list[dict[str, Any]]
    samples: list[Sample]
    max_tokens: int = 2048
    temperature: float = 0.0
    proposer: dict[str, Any] | None = None  # a `model:` config (engine, source/path/url, ...); None: the scenario's


@dataclass
class WeightJob:
    """A candidate to train: the trainer spec's recipe-owned part (see reefd/train for the rest)."""

    algorithm: str
    samples: list[Sample]
    lora: dict[str, Any]
    optim: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)  # algorithm settings, e.g. the clipping band


class Recipe(Protocol):
    Config: ClassVar[type]
    trains: ClassVar[bool]

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None: ...

    def ready(self, samples: list[Sample]) -> bool: ...

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob | HarnessJob: ...


class HarnessRecipe(Recipe, Protocol):
    """A recipe whose candidates are harness edits (its `candidate` returns a HarnessJob)."""

    def edit(self, answer: str, harness: Harness) -> list[dict[str, Any]]:
        """The proposer's answer -> harness mutations; RecipeError for a malformed or unsafe answer (the candidate
        is then skipped with that reason, and nothing is published)."""
        ...


@dataclass
class RecordOnlyConfig:
    """The record recipe has no settings."""


class RecordOnly:
    """The default: record every turn, never train."""

    Config = RecordOnlyConfig
    trains = False

    def __init__(self, cfg: RecordOnlyConfig) -> None:
        self.cfg = cfg

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return None

    def ready(self, samples: list[Sample]) -> bool:
        return False

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        raise RecipeError("the record recipe does not train")


def scored_rollout(record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
    """The common eligibility rule: a record with engine token ids and logprobs and a numeric score (the
    latest report's score counts). Upstream records (no token ids) and unscored records are not eligible."""
    ids, logprobs = record.get("completion_token_ids"), record.get("completion_logprobs")
    prompt = record.get("prompt_token_ids")
    if not ids or not prompt or not isinstance(logprobs, list) or len(logprobs) != len(ids):
        return None
    scores = [r for r in reports if isinstance(r.get("score"), int | float) and not isinstance(r.get("score"), bool)]
    if not scores or not math.isfinite(float(scores[-1]["score"])):
        return None
    group = hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in prompt)).hexdigest()[:16]
    return Sample(receipt=record["id"], prompt_ids=list(prompt), completion_ids=list(ids),
                  logprobs=list(logprobs), reward=float(scores[-1]["score"]), group=group,
                  reports=[r["report_id"] for r in scores])


def resolve(name: str) -> Any:
    """The recipe class for a shipped name or a `pkg.mod:Class` path."""
    path = SHIPPED.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RecipeError(f"unknown recipe {name!r}: use one of {', '.join(sorted(SHIPPED))} or pkg.mod:Class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(f"recipe {name!r} cannot be imported: {exc}") from None
    for needed in ("Config", "sample", "ready", "candidate"):
        if not hasattr(cls, needed):
            raise RecipeError(f"recipe {name!r} has no {needed!r}: see reefd/recipes.py for the contract")
    if not dataclasses.is_dataclass(cls.Config):
        raise RecipeError(f"recipe {name!r}: its Config must be a dataclass")
    return cls


def build(name: str, params: dict[str, Any]) -> Recipe:
    """An instance of the recipe, its `params` validated against its Config (errors name `recipe.params.KEY`)."""
    cls = resolve(name)
    validator = jsonschema.Draft202012Validator(dataclass_schema(cls.Config))
    errors = sorted(validator.iter_errors(params), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = ".".join(["recipe.params", *(str(p) for p in err.absolute_path)])
        raise RecipeError(f"{where}: {err.message}")
    recipe: Recipe = cls(cls.Config(**params))
    return recipe
