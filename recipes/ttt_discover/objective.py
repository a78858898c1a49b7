"""TTT-Discover as a trainer objective (reefd/train/objective.py): the importance-sampling policy gradient on
entropic advantages, with a centered KL penalty to the frozen base folded into the advantages.

Per token t of attempt i: A_it = A_i + kl_coef · (mean(d) − d_it), with A_i the attempt's entropic leave-one-out
advantage (the recipe computed it per group, entropic.py), d_it = log p_sample − log p_base the sampled token's
log-ratio to the frozen base, and mean(d) its mean over every token of the grid. The loss is
−Σ_t exp(log p_θ − log p_sample) · A_it, summed over tokens, with no clip. The recipe makes the whole grid one
micro-batch, so a grid is one Adam step. Imports torch; the trainer process loads it by path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from reefd.train.batch import Batch
from reefd.train.objective import Context, Outputs


@dataclass(frozen=True)
class TTTSettings:
    """kl_coef: the centered KL penalty's coefficient (0 turns it off and skips the base model's pass)."""

    kl_coef: float = field(default=0.1, metadata={"minimum": 0})


class TTTObjective:
    Settings: ClassVar[type] = TTTSettings
    needs: ClassVar[tuple[str, ...]] = ("extra",)

    def __init__(self, settings: TTTSettings, ctx: Context) -> None:
        for i, s in enumerate(ctx.samples):
            if not isinstance((s.extra or {}).get("advantage"), int | float):
                raise ValueError(f"samples[{i}].extra.advantage: missing (the ttt-discover recipe sets it)")
        self.settings, self.ctx = settings, ctx
        self.sums = {"kl": 0.0, "tokens": 0.0, "ratio": 0.0}

    def terms(self, batch: Batch, out: Outputs) -> tuple[Tensor, Tensor, Tensor]:
        """(per-token advantages [B, T], sampling log-probs [B, T], the log-ratio to the base d [B, T]), all
        without gradient. A token without an engine logprob counts as sampled by the current policy."""
        mask = batch.tokens
        with torch.no_grad():
            sampled = torch.where(batch.valid, batch.rollout_logp, out.logp.detach())
            adv = torch.tensor([float((self.ctx.samples[i].extra or {})["advantage"]) for i in batch.index],
                               dtype=sampled.dtype).unsqueeze(-1).expand_as(sampled).clone()
            diff = torch.zeros_like(sampled)
            if self.settings.kl_coef > 0:
                if self.ctx.reference is None:
                    raise ValueError("the KL penalty needs the frozen base model (Context.reference)")
                diff = torch.where(mask, sampled - self.ctx.reference(batch).logp, 0.0)
                mean = diff[mask].mean() if bool(mask.any()) else diff.new_zeros(())
                adv = adv + self.settings.kl_coef * (mean - diff)
            adv = torch.where(mask, adv, 0.0)
        return adv, sampled, diff

    def loss(self, batch: Batch, out: Outputs) -> tuple[Tensor, dict[str, float]]:
        adv, sampled, diff = self.terms(batch, out)
        mask = batch.tokens
        ratio = torch.exp(out.logp - sampled)
        loss = -(ratio * adv * mask).sum()
        n = float(mask.sum())
        with torch.no_grad():
            kl = float((diff * mask).sum()) / max(n, 1.0)
            mean_ratio = float((ratio.detach() * mask).sum()) / max(n, 1.0)
        self.sums["kl"] += kl * n
        self.sums["ratio"] += mean_ratio * n
        self.sums["tokens"] += n
        return loss, {"kl": kl, "ratio": mean_ratio}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {}

    def save(self, folder: Path) -> None:
        return None

    def metrics(self) -> dict[str, Any]:
        n = max(self.sums["tokens"], 1.0)
        betas = sorted({float((s.extra or {}).get("beta", 0.0)) for s in self.ctx.samples})
        return {"kl": round(self.sums["kl"] / n, 6), "ratio": round(self.sums["ratio"] / n, 6),
                "groups": len({s.group for s in self.ctx.samples}), "betas": [round(b, 6) for b in betas]}
