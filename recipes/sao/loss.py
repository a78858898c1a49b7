"""SAO's per-token policy loss (DIS) and its two advantage estimators: token-level GAE on a critic's
values (SAO) and group-relative rewards (the GRPO control).

Tensors are completion-aligned, shape [B, T]: column t is the t-th completion token of each row.
Knows nothing about models, batching or files; the critic's own training lives in `critic`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def dis_weights(logp: Tensor, rollout_logp: Tensor, valid: Tensor, eps_low: float, eps_high: float,
                cap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """f(r), detached, and the in-band mask, for r = exp(logp - rollout_logp).

    f(r) = r strictly inside (1 - eps_low, 1 + eps_high) and 0 outside, whatever the sign of the
    advantage (the paper's strict double-side token-level clipping); tokens that are not `valid`
    (padding, or a null rollout logprob) get 0 and count as neither in nor out of the band. With `cap`
    (broadcast to [B, T]), an in-band f(r) is at most cap: truncated importance sampling for stale samples.
    """
    with torch.no_grad():
        ratio = torch.exp(logp.detach() - rollout_logp)
        in_band = valid & (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
        kept = ratio if cap is None else torch.minimum(ratio, cap)
        weights = torch.where(in_band, kept, torch.zeros_like(ratio))
    return weights, in_band


def policy_loss(logp: Tensor, rollout_logp: Tensor, advantages: Tensor, valid: Tensor,
                eps_low: float, eps_high: float, cap: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """L = -sum_t sg(f(r_t)) * A_t * log p_theta(token_t) / (number of valid tokens in the batch).

    The gradient of each in-band token is r_t * A_t * grad log p = A_t * grad r_t (the IS-weighted
    policy gradient); an out-of-band token gives none. Token-mean over every valid completion token
    of the micro-batch, in band or not, so masking a token never re-weights the others.
    Returns the loss and its statistics (clip_frac: the share of valid tokens outside the band). `cap`
    truncates f(r) (see dis_weights).
    """
    weights, in_band = dis_weights(logp, rollout_logp, valid, eps_low, eps_high, cap)
    per_token = weights * advantages.detach() * logp
    total = torch.where(valid, per_token, torch.zeros_like(per_token)).sum()
    n_valid = int(valid.sum())
    loss = -total / max(n_valid, 1)
    with torch.no_grad():
        ratio_all = torch.exp(logp.detach() - rollout_logp)
        ratio = ratio_all[valid]
        stats = {
            "valid_tokens": float(n_valid),
            "clipped_tokens": float(n_valid - int(in_band.sum())),
            "clip_frac": (n_valid - int(in_band.sum())) / n_valid if n_valid else 0.0,
            "ratio_mean": float(ratio.mean()) if n_valid else 1.0,
            "truncated_tokens": 0.0 if cap is None else float(int((in_band & (weights < ratio_all)).sum())),
        }
    return loss, stats


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda, which SAO adopts: lambda = 1 - 1 / (alpha * length)."""
    return (1.0 - 1.0 / (alpha * lengths.to(torch.float32))).clamp(min=0.0)


def gae_advantages(values: Tensor, rewards: Tensor, lengths: Tensor, lam: Tensor) -> Tensor:
    """Token-level GAE with gamma = 1 and the outcome reward on each row's last completion token.

    values[b, t] = V(s_t), the value of the state before completion token t. With the next value
    V(s_{t+1}) (or the reward R after the last token), delta_t = next - V(s_t) and
    A_t = delta_t + lam_b * A_{t+1}. lam = 1 gives A_t = R - V(s_t). Positions past a row's
    length get 0. Rows are single-turn (prompt -> completion): no observation tokens to skip.
    """
    batch, width = values.shape
    adv = torch.zeros_like(values)
    next_adv = torch.zeros(batch, dtype=values.dtype)
    for t in reversed(range(width)):
        inside = lengths.gt(t)
        last = lengths.eq(t + 1)
        following = values[:, t + 1] if t + 1 < width else torch.zeros(batch, dtype=values.dtype)
        next_value = torch.where(last, rewards.to(values.dtype), following)
        step = next_value - values[:, t] + lam * torch.where(last, torch.zeros_like(next_adv), next_adv)
        next_adv = torch.where(inside, step, torch.zeros_like(step))
        adv[:, t] = next_adv
    return adv


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float) -> Tensor:
    """The GRPO control: A_i = (r_i - mean(group_i)) / (std(group_i) + eps), population std.

    A group of one has std 0 and gets A = 0 (no baseline to compare with, no signal).
    """
    values = torch.tensor(list(rewards), dtype=torch.float64)
    out = torch.zeros_like(values)
    members: dict[str, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    for idx in members.values():
        group = values[idx]
        out[idx] = (group - group.mean()) / (group.std(unbiased=False) + eps)
    return out.to(torch.float32)


def whiten(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(A - mean) / (std + eps) over the masked tokens (the optional batch normalisation)."""
    picked = advantages[mask]
    if picked.numel() < 2:
        return advantages
    out = (advantages - picked.mean()) / (picked.std(unbiased=False) + eps)
    return torch.where(mask, out, torch.zeros_like(out))
