"""The trainer side of the REINFORCE test recipe: loss = -mean over completion tokens of (r - b) * log p(token),
with b the job's mean reward (or 0). No ratios, no critic, no group: the policy gradient in its plainest form."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from reefd.train.batch import Batch
from reefd.train.objective import Context, Outputs


@dataclass(frozen=True)
class ReinforceSettings:
    baseline: str = field(default="mean")  # "mean": the job's mean reward; "none": 0


class Reinforce:
    Settings: ClassVar[type] = ReinforceSettings
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: ReinforceSettings, ctx: Context) -> None:
        if settings.baseline not in ("mean", "none"):
            raise ValueError(f"baseline: {settings.baseline!r} is not mean or none")
        rewards = [s.reward for s in ctx.samples]
        self.baseline = sum(rewards) / len(rewards) if settings.baseline == "mean" else 0.0
        self.steps = 0

    def loss(self, batch: Batch, out: Outputs) -> tuple[Tensor, dict[str, float]]:
        advantage = (batch.rewards - self.baseline).unsqueeze(-1)
        per_token = torch.where(batch.tokens, advantage * out.logp, torch.zeros_like(out.logp))
        self.steps += 1
        return -per_token.sum() / batch.tokens.sum().clamp(min=1), {"baseline": self.baseline}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {}

    def save(self, folder: Path) -> None:
        (folder / "reinforce.json").write_text(f'{{"baseline": {self.baseline}}}\n')

    def metrics(self) -> dict[str, Any]:
        return {"objective": "reinforce", "baseline": self.baseline, "objective_steps": self.steps}
