"""SAO and its GRPO control as trainer objectives (reefd/train/objective.py): the DIS policy loss on each
micro-batch, with token-level GAE on a critic's values (SAO) or group-relative rewards (GRPO).

Imports torch; the trainer process loads it by the path the recipe's job spec names. The maths is in loss.py and
critic.py; this module only wires them to the generic loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from recipes.sao import CRITIC_FILE
from recipes.sao.critic import ValueHead, critic_update, explained_variance, load_critic, save_critic
from recipes.sao.loss import gae_advantages, group_advantages, length_adaptive_lambda, policy_loss, whiten
from reefd.train.batch import Batch
from reefd.train.objective import Context, Outputs


@dataclass(frozen=True)
class SAOSettings:
    """The loss and critic settings (recipes/sao/README.md says where each default comes from).

    eps_low/eps_high: the DIS trust band (1 - eps_low, 1 + eps_high) on r = p_theta / p_rollout.
    critic_lr, critic_updates: the value head's AdamW lr and its updates per policy step (K).
    gae_alpha: length-adaptive GAE, lambda = 1 - 1 / (gae_alpha * completion length).
    normalize_advantages: whiten the advantages of each micro-batch whose rewards differ (off in the paper's recipe).
    grpo_eps: the GRPO control's std floor, A = (r - mean) / (std + grpo_eps).
    stale_clip: a stale sample's f(r) is at most this (samples kept past max_staleness with `stale: weight`).
    """

    eps_low: float = field(default=0.3, metadata={"exclusiveMinimum": 0, "maximum": 1})
    eps_high: float = field(default=5.0, metadata={"exclusiveMinimum": 0})
    critic_lr: float = field(default=1e-3, metadata={"exclusiveMinimum": 0})
    critic_updates: int = field(default=2, metadata={"minimum": 1})
    gae_alpha: float = field(default=1.5, metadata={"exclusiveMinimum": 0})
    normalize_advantages: bool = False
    grpo_eps: float = field(default=1e-6, metadata={"exclusiveMinimum": 0})
    stale_clip: float = field(default=2.0, metadata={"minimum": 1})


class _DIS:
    """The DIS loss on advantages a subclass computes, and the statistics both estimators report."""

    Settings: ClassVar[type] = SAOSettings
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: SAOSettings, ctx: Context) -> None:
        self.settings, self.ctx = settings, ctx
        self.valid = self.clipped = self.abs_adv = self.stale_tokens = self.truncated = 0.0

    def advantages(self, batch: Batch, out: Outputs) -> Tensor:
        raise NotImplementedError

    def loss(self, batch: Batch, out: Outputs) -> tuple[Tensor, dict[str, float]]:
        s = self.settings
        with torch.no_grad():
            adv = self.advantages(batch, out)
            if s.normalize_advantages and bool((batch.rewards != batch.rewards[0]).any()):
                # A micro-batch whose answers all scored the same says nothing about which is better; whitening
                # it would blow the critic's noise up to unit-sized advantages, so it keeps its raw ones.
                adv = whiten(adv, batch.valid)
        cap = None
        if batch.stale is not None and bool(batch.stale.any()):  # truncated importance sampling on stale samples
            cap = torch.where(batch.stale, s.stale_clip, math.inf).unsqueeze(-1)
            self.stale_tokens += int((batch.valid & batch.stale.unsqueeze(-1)).sum())
        loss, stats = policy_loss(out.logp, batch.rollout_logp, adv, batch.valid, s.eps_low, s.eps_high, cap)
        self.valid += stats["valid_tokens"]
        self.clipped += stats["clipped_tokens"]
        self.truncated += stats["truncated_tokens"]
        self.abs_adv += float(adv[batch.valid].abs().sum())
        return loss, {"clip_frac": stats["clip_frac"], **self.after(batch, out)}

    def after(self, batch: Batch, out: Outputs) -> dict[str, float]:
        """Work after the advantages are taken (SAO: the critic's update); its stats join the progress line."""
        return {}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {}

    def save(self, folder: Path) -> None:
        return None

    def metrics(self) -> dict[str, Any]:
        out = {"clip_frac": self.clipped / self.valid if self.valid else 0.0,
               "mean_abs_advantage": self.abs_adv / self.valid if self.valid else 0.0}
        if self.stale_tokens:  # the share of stale tokens whose f(r) stale_clip truncated
            out["stale_truncated_frac"] = self.truncated / self.stale_tokens
        return out


class SAOObjective(_DIS):
    """Single-rollout: token-level GAE on a value head's estimates; the head is updated K times per step, after
    the advantages used it, and persists beside the adapter (critic.safetensors) from job to job."""

    def __init__(self, settings: SAOSettings, ctx: Context) -> None:
        super().__init__(settings, ctx)
        path = None if ctx.init_adapter is None else ctx.init_adapter / CRITIC_FILE
        if path is not None and path.is_file():
            self.critic, self.updates = load_critic(path, ctx.hidden_size)
        else:  # fresh: V = the batch's mean reward
            self.critic, self.updates = ValueHead(ctx.hidden_size, sum(s.reward for s in ctx.samples)
                                                  / len(ctx.samples)), 0
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=settings.critic_lr, weight_decay=0.0)
        self.value_losses: list[float] = []
        self._values: list[Tensor] = []
        self._targets: list[Tensor] = []

    def advantages(self, batch: Batch, out: Outputs) -> Tensor:
        values = self.critic(out.hidden.detach())
        self._values.append(values[batch.tokens])  # before the head's update on this batch (Fig. 4a)
        self._targets.append(batch.rewards.unsqueeze(-1).expand_as(values)[batch.tokens])
        lam = length_adaptive_lambda(batch.lengths, self.settings.gae_alpha)
        return gae_advantages(values, batch.rewards, batch.lengths, lam)

    def after(self, batch: Batch, out: Outputs) -> dict[str, float]:
        targets = batch.rewards.unsqueeze(-1).expand_as(out.logp)
        losses = critic_update(self.critic, self.critic_opt, out.hidden, targets, batch.tokens,
                               self.settings.critic_updates)
        self.updates += len(losses)
        self.value_losses.append(losses[0])
        return {"value_loss": losses[0]}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"critic": self.critic_opt}

    def save(self, folder: Path) -> None:
        save_critic(self.critic, folder / CRITIC_FILE, self.updates)

    def metrics(self) -> dict[str, Any]:
        values, targets = torch.cat(self._values), torch.cat(self._targets)
        return {**super().metrics(), "value_loss": sum(self.value_losses) / len(self.value_losses),
                "explained_variance": explained_variance(values, targets, torch.ones_like(values, dtype=torch.bool))}


class GRPOObjective(_DIS):
    """The control: the same ratio band, each sample's advantage relative to the rollouts of its prompt (its
    group), on every token."""

    needs = ("group",)

    def __init__(self, settings: SAOSettings, ctx: Context) -> None:
        super().__init__(settings, ctx)
        self.group_adv = group_advantages([s.reward for s in ctx.samples], [str(s.group) for s in ctx.samples],
                                          settings.grpo_eps)

    def advantages(self, batch: Batch, out: Outputs) -> Tensor:
        return self.group_adv[batch.index].unsqueeze(-1) * batch.tokens
