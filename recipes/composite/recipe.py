"""Composite as a recipe: one batch, two recipes, one candidate. The weights recipe (SAO by default) takes the
batch and trains an adapter on it; the harness recipe (SkillClaw by default) reads the same records, the ones it
finds something in (low verdicts, feedback), and proposes harness edits. reefd gates the pair once and releases it
as one `bundle` release, swapped and rolled back together.

Owns how the two recipes share a batch; each keeps its own eligibility, settings and contract. It does not
train, propose, gate or publish (reefd/grow/job_kinds/bundle_job.py). See README.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reefd.grow.recipes import (
    Ages,
    Bundle,
    CapturesTopK,
    HarnessJob,
    Judged,
    JudgeSettings,
    Policy,
    Recipe,
    RecipeError,
    Sample,
    WeightJob,
    build,
)

if TYPE_CHECKING:
    from reefd.harness import Harness

HARNESS_SAMPLE = "harness_sample"  # a batch sample's context: what the harness recipe made of the same record


@dataclass
class CompositeConfig:
    """Composite's settings (see recipes/composite/README.md)."""

    weights: str = field(default="sao", metadata={
        "description": "The recipe that trains the adapter (a shipped name or pkg.mod:Class producing weights)."})
    weights_params: dict[str, Any] = field(default_factory=dict, metadata={
        "description": "Its params, as its own recipe.params (batch_size decides the batch)."})
    harness: str = field(default="skillclaw", metadata={
        "description": "The recipe that proposes harness edits from the same batch (a HarnessJob recipe)."})
    harness_params: dict[str, Any] = field(default_factory=dict, metadata={
        "description": "Its params, as its own recipe.params (its batch_size is a cap: it sees the records of "
                       "the batch it finds something in)."})


class Composite:
    """The weights recipe's batch trains the adapter; the harness recipe proposes from the same records."""

    Config = CompositeConfig
    produces = "both"

    def __init__(self, cfg: CompositeConfig) -> None:
        self.cfg = cfg
        self.weights: Recipe = _part(cfg.weights, cfg.weights_params, "weights", ("weights",))
        self.harness: Recipe = _part(cfg.harness, cfg.harness_params, "harness", ("harness",))
        # what the weights recipe declares, declared for it (the harness recipe needs none of these)
        self.staleness: Policy = self.weights.staleness if isinstance(self.weights, Ages) else Policy()
        self.capture_top_k: int = self.weights.capture_top_k if isinstance(self.weights, CapturesTopK) else 0
        self.judge: JudgeSettings | None = self.weights.judge if isinstance(self.weights, Judged) else None

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        """The weights recipe's sample of the record, carrying the harness recipe's one when it takes it too."""
        sample = self.weights.sample(record, reports)
        if sample is None:
            return None
        other = self.harness.sample(record, reports)
        if other is None:
            return sample
        return dataclasses.replace(sample, context={**sample.context, HARNESS_SAMPLE: other})

    def ready(self, samples: list[Sample]) -> bool:
        return self.weights.ready(samples)

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> Bundle:
        spec = self.weights.candidate(samples, harness)
        if not isinstance(spec, WeightJob) or spec.target != "lora":
            raise RecipeError(f"recipe.params.weights: {self.cfg.weights!r} must train a LoRA adapter for a bundle")
        if harness is None:
            raise RecipeError("composite evolves a harness too: set harness.dir in the scenario")
        theirs = [s.context[HARNESS_SAMPLE] for s in spec.samples if HARNESS_SAMPLE in s.context]
        proposal = self.harness.candidate(theirs, harness) if theirs else None
        if proposal is not None and not isinstance(proposal, HarnessJob):
            raise RecipeError(f"recipe.params.harness: {self.cfg.harness!r} must propose one harness edit "
                              "(a search recipe such as gepa cannot share a batch)")
        return Bundle(weights=spec, harness=proposal, samples=spec.samples)


def _part(name: str, params: dict[str, Any], key: str, produces: tuple[str, ...]) -> Recipe:
    if name == "composite":
        raise RecipeError(f"recipe.params.{key}: a composite cannot hold a composite")
    try:
        recipe = build(name, dict(params))
    except RecipeError as exc:
        said = str(exc)  # a param's error names recipe.params[.KEY]: here, recipe.params.<key>_params[.KEY]
        raise RecipeError(f"recipe.params.{key}_params{said.removeprefix('recipe.params')}"
                          if said.startswith("recipe.params") else f"recipe.params.{key}: {said}") from None
    if recipe.produces not in produces:
        raise RecipeError(f"recipe.params.{key}: {name!r} produces {recipe.produces}, not {produces[0]}")
    return recipe
