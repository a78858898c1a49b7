"""One micro-batch of rollouts as tensors, completion-aligned: column t of a [B, T] tensor is completion token t
(`stale_weights`: what an objective may apply to samples kept past max_staleness). Imports torch: trainer process
only. Knows nothing about models, losses or files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reefd.train.spec import Rollout


@dataclass
class Batch:
    """One right-padded micro-batch."""

    index: list[int]  # each row's position in the job's samples (Context.samples)
    input_ids: Tensor  # [B, L] prompt + completion, right padded
    attention_mask: Tensor  # [B, L]
    positions: Tensor  # [B, T] the input position whose output predicts completion token t
    completion: Tensor  # [B, T]
    rollout_logp: Tensor  # [B, T] the engine's logprob (0 where null)
    tokens: Tensor  # [B, T] bool: a completion token (not padding)
    valid: Tensor  # [B, T] bool: a completion token with a rollout logprob
    lengths: Tensor  # [B] completion lengths
    rewards: Tensor  # [B]
    n_tokens: int  # prompt + completion tokens, padding excluded
    top_ids: Tensor | None = None  # [B, T, K] the engine's top-K ids per completion token (0: padding, or none)
    stale: Tensor | None = None  # [B] bool: past the recipe's max_staleness, to be importance-weighted


def stale_weights(batch: Batch, logp: Tensor, clip: float) -> Tensor:
    """[B, T] without gradient: the truncated importance ratio min(exp(logp - rollout logp), clip) on the tokens of
    stale rows that have a rollout logprob, 1 everywhere else (fresh rows, tokens without one, padding)."""
    with torch.no_grad():
        ones = torch.ones_like(logp)
        if batch.stale is None or not bool(batch.stale.any()):
            return ones
        ratio = torch.exp(logp.detach() - batch.rollout_logp).clamp(max=clip)
        return torch.where(batch.valid & batch.stale.unsqueeze(-1), ratio, ones)


def collate(samples: list[Rollout], index: list[int], pad_id: int) -> Batch:
    """The rows `index` of `samples` as one batch."""
    rows = [samples[i] for i in index]
    ids = [s.prompt_ids + s.completion_ids for s in rows]
    width, depth = max(len(r) for r in ids), max(len(s.completion_ids) for s in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, depth), dtype=torch.long)
    completion = torch.zeros((n, depth), dtype=torch.long)
    rollout = torch.zeros((n, depth), dtype=torch.float32)
    tokens = torch.zeros((n, depth), dtype=torch.bool)
    valid = torch.zeros((n, depth), dtype=torch.bool)
    for i, (s, row) in enumerate(zip(rows, ids, strict=True)):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        positions[i, :c] = torch.arange(p - 1, p - 1 + c)
        completion[i, :c] = torch.tensor(s.completion_ids)
        tokens[i, :c] = True
        for j, lp in enumerate(s.logprobs):
            if lp is not None:
                rollout[i, j], valid[i, j] = lp, True
    top = None
    widths = {len(s.top_ids[0]) for s in rows if s.top_ids}
    if len(widths) > 1:
        raise ValueError(f"samples of one batch captured different top-K widths: {sorted(widths)}")
    if widths:  # rows without a capture get token 0: an objective masks them out
        top = torch.zeros((n, depth, widths.pop()), dtype=torch.long)
        for i, s in enumerate(rows):
            if s.top_ids:
                top[i, : len(s.top_ids)] = torch.tensor(s.top_ids)
    return Batch(list(index), input_ids, attention, positions, completion, rollout, tokens, valid,
                 lengths=torch.tensor([len(s.completion_ids) for s in rows]),
                 rewards=torch.tensor([s.reward for s in rows], dtype=torch.float32), n_tokens=sum(len(r) for r in ids),
                 top_ids=top, stale=torch.tensor([s.stale for s in rows], dtype=torch.bool))
