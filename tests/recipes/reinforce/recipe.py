"""The daemon side of the REINFORCE test recipe: scored rollouts -> a trainer job that names its own objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reefd.grow.recipes import Sample, WeightJob, scored_rollout

if TYPE_CHECKING:
    from reefd.harness import Harness


@dataclass
class ReinforceConfig:
    batch_size: int = field(default=4, metadata={"minimum": 1})
    lr: float = field(default=1e-2, metadata={"exclusiveMinimum": 0})


class Reinforce:
    Config = ReinforceConfig
    produces = "weights"

    def __init__(self, cfg: ReinforceConfig) -> None:
        self.cfg = cfg

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return scored_rollout(record, reports)

    def ready(self, samples: list[Sample]) -> bool:
        return len(samples) >= self.cfg.batch_size

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        return WeightJob(objective="tests.recipes.reinforce.objective:Reinforce",
                         samples=samples[: self.cfg.batch_size],
                         lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                         optim={"lr": self.cfg.lr, "micro_batch": 4}, settings={"baseline": "mean"})
