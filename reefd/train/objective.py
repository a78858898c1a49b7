"""The trainer-side plug point: a weight recipe's training objective, found by the path its job spec names
(`"objective": "pkg.mod:Class"`, with its `settings`) and asked for each micro-batch's loss; the generic loop
(training.py) owns the rest. Imports torch: trainer process only. Knows no recipe beyond that path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from reefd import plugins
from reefd.train.batch import Batch
from reefd.train.spec import Rollout, SpecError, TrainSpec, block

SAMPLE_FIELDS = ("reward", "group", "logprobs", "receipt", "top_ids", "extra")  # what `needs` may list


@dataclass(frozen=True)
class Context:
    """What an objective is built with, besides its settings."""

    samples: list[Rollout]  # the job's rollouts, in spec order (Batch.index points into this list)
    hidden_size: int  # of the policy's last hidden states (Outputs.hidden)
    init_adapter: Path | None  # the adapter folder the job continues from, with any files `save` wrote there
    base_model: Path | None = None  # the base model's folder (its tokenizer and chat template: reefd.serve.chat)
    # the frozen base model (adapter disabled, no gradient) on a batch: what a KL penalty or a teacher needs;
    # `reference(batch, own_top=k)` also gives its own k most likely ids per position (Outputs.own_top_ids)
    reference: Callable[..., Outputs] | None = None


@dataclass
class Outputs:
    """What the policy computed for a micro-batch."""

    logp: Tensor  # [B, T] log-probs of the completion tokens under the policy being trained (with gradient)
    hidden: Tensor  # [B, T, H] the last hidden states that predict them (with gradient)
    top_logp: Tensor | None = None  # [B, T, K] log-probs of the batch's top-K ids (when its samples have them)
    own_top_ids: Tensor | None = None  # [B, T, k] the model's own most likely ids, when asked (`own_top`)


class Objective(Protocol):
    """A weight recipe's training objective: `Settings` is a frozen dataclass with defaults (the spec's
    `settings` block is validated into it, bounds from its fields' metadata), `needs` lists the optional sample
    fields it reads (of SAMPLE_FIELDS: a spec whose samples lack one is refused before training), and the loop
    builds it as `Class(settings, context)`.

    Guarantees the loop gives an objective:
    - `loss` is called once per micro-batch, in order, `epochs` passes over the samples shuffled by the spec's
      seed; the policy's optimizer (AdamW over the LoRA weights) then steps on the loss's gradient, clipped to
      `optim.max_grad_norm`. A non-finite loss or gradient stops the job before that step (exit 3).
    - the floats in the stats `loss` returns go into that step's progress line; `metrics()` goes into the job's
      `done` line and metrics.json.
    - `optimizers()` (auxiliary ones, e.g. a critic's) have their state carried to the next job of a warm trainer
      that continues from this job's adapter, as the policy's AdamW state is; their learning rates are the new
      job's.
    - `save` writes extra files (a critic) into the candidate folder before it is fsynced and renamed into place,
      and a later job that continues from that adapter finds them in `Context.init_adapter`.
    - the loop batches `Context.samples` (the list itself) after the objective is built, so an objective may
      replace a sample there when it is built, with the same tokens and wider `top_ids` (a larger set of ids
      to score); nothing else of a sample may change.
    - a sample its recipe kept past max_staleness (`stale: weight`) is `stale` (Batch.stale); an objective
      importance-weights it against its rollout logprobs (batch.stale_weights gives the truncated ratio).
    """

    Settings: ClassVar[type]
    needs: ClassVar[tuple[str, ...]]

    def loss(self, batch: Batch, out: Outputs) -> tuple[Tensor, dict[str, float]]: ...

    def optimizers(self) -> dict[str, torch.optim.Optimizer]: ...

    def save(self, folder: Path) -> None: ...

    def metrics(self) -> dict[str, Any]: ...


def resolve(spec: TrainSpec) -> tuple[Any, Any]:
    """The objective class the spec names and its checked settings, before any model is loaded; SpecError (a bad
    spec, exit 2) when it cannot be imported, is not an Objective, refuses its settings or needs a sample field
    the spec lacks. The loop then builds it: `cls(settings, Context(...))`."""
    try:
        cls = plugins.resolve({}, spec.objective, "objective")
    except plugins.PluginError as exc:
        raise SpecError(f"objective: {exc}") from None
    missing = plugins.missing(Objective, cls)
    if missing:
        raise SpecError(f"objective: {spec.objective} is not an Objective (no {', '.join(missing)})")
    for name in cls.needs:
        if name not in SAMPLE_FIELDS:
            raise SpecError(f"objective: {spec.objective} needs {name!r}, not a sample field ({SAMPLE_FIELDS})")
        for i, sample in enumerate(spec.samples):
            if getattr(sample, name) is None:
                raise SpecError(f"samples[{i}].{name}: missing ({spec.objective} needs it)")
    return cls, block(cls.Settings, spec.settings, "settings")
