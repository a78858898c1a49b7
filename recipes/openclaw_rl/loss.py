"""OpenClaw-RL's two per-token terms, on completion-aligned tensors (column t is completion token t).

- `pg_terms`: PPO-clip with the judge's verdict as the advantage of every response token.
- `opd_terms`: on-policy distillation over a top-K set of tokens: each token v of the set is pushed by
  clamp(teacher - old, -c, c) weighted by softmax(old) over the set, through the same clipped ratio, and summed
  over the set.

Both return per-token losses (0 where masked); `sample_mean` averages them over each sample's tokens. Knows
nothing about models, batching or files.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _clipped(adv: Tensor, logp: Tensor, old: Tensor, eps: float, eps_high: float, clamp: float) -> Tensor:
    """max(-A ρ, -A clip(ρ, 1 - eps, 1 + eps_high)), ρ = exp(clamp(logp - old, ±clamp)) (elementwise)."""
    ratio = torch.exp((logp - old).clamp(-clamp, clamp))
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps, 1.0 + eps_high))


def pg_terms(logp: Tensor, old: Tensor, reward: Tensor, mask: Tensor, eps: float = 0.2, eps_high: float = 0.28,
             clamp: float = 20.0) -> Tensor:
    """[B, T] PPO-clip losses with A_t = reward (per sample, [B]) on every token; 0 where not `mask`."""
    adv = reward.detach().unsqueeze(-1).expand_as(logp)
    per_token = _clipped(adv, logp, old.detach(), eps, eps_high, clamp)
    return torch.where(mask, per_token, torch.zeros_like(per_token))


def opd_terms(top_logp: Tensor, old_top: Tensor, teacher_top: Tensor, mask: Tensor, eps: float = 0.2,
              eps_high: float = 0.28, clamp: float = 20.0, diff_clip: float = 1.0) -> tuple[Tensor, Tensor]:
    """[B, T] distillation losses over the top-K set ([B, T, K] log-probs: current, old, teacher), and the
    [B, T, K] advantages A_v = softmax(old over the set)_v * clamp(teacher_v - old_v, -diff_clip, diff_clip)."""
    with torch.no_grad():
        weights = torch.softmax(old_top, dim=-1)
        adv = weights * (teacher_top - old_top).clamp(-diff_clip, diff_clip)
    per_token = _clipped(adv, top_logp, old_top.detach(), eps, eps_high, clamp).sum(dim=-1)  # summed over the set
    return torch.where(mask, per_token, torch.zeros_like(per_token)), adv


def sample_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """[B] each sample's mean over its masked tokens (0 for a sample with none)."""
    count = mask.sum(dim=-1).clamp(min=1)
    return per_token.sum(dim=-1) / count
