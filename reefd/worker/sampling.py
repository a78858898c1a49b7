"""Batched next-token sampling with per-row parameters and per-row random streams.

Owns temperature / top-k / top-p / min-p and the logprob convention: the returned logprob
(and each top-logprob alternative) is log_softmax of the *raw* logits (temperature 1, before
any filtering), i.e. the policy's logprob of the token. Knows nothing about requests, caches or text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reefd.worker.params import SamplingParams

LOGPROB_CHUNK = 4096  # prompt positions whose log-softmax is computed at once


def _filter(scaled: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """Set the logits that top-k / top-p / min-p remove to -inf (one sort for the batch)."""
    vocab = scaled.shape[-1]
    device = scaled.device
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in rows], device=device)
    top_p = torch.tensor([p.top_p for p in rows], device=device, dtype=scaled.dtype)
    min_p = torch.tensor([p.min_p for p in rows], device=device, dtype=scaled.dtype)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).expand_as(sorted_logits)
    remove = ranks >= ks[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    remove |= before > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False  # the best token always survives
    return scaled.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingParams], uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` (batch, vocab).

    `uniforms` holds one U[0,1) draw per row (from that row's own generator), so a
    row's choice depends only on its own logits and its own draw, never on its batch
    partners. Sampling is by inverse CDF in vocabulary order. Returns (tokens, logprobs).
    """
    logits = logits.float()
    logprobs = logits.log_softmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(rows) if not p.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        sub = [rows[i] for i in sampled]
        temps = torch.tensor([p.temperature for p in sub], device=logits.device)
        scaled = logits.index_select(0, index) / temps[:, None]
        if any(p.filters for p in sub):
            scaled = _filter(scaled, sub)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        target = uniforms.to(logits.device).index_select(0, index)[:, None] * cdf[:, -1:]
        picked = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
        tokens = tokens.index_copy(0, index, picked[:, 0])
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, ks: Sequence[int]) -> list[list[list[Any]] | None]:
    """Each row's `ks[i]` best tokens as [[logprob, token_id, None], ...], best first (None where k is 0).

    Same convention as `sample`: log_softmax of the raw logits, before temperature or filters.
    Only the rows that ask are computed, with one `topk` for the largest k among them.
    """
    wanted = [i for i, k in enumerate(ks) if k > 0]
    out: list[list[list[Any]] | None] = [None] * len(ks)
    if not wanted:
        return out
    index = torch.tensor(wanted, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
    k = min(max(ks[i] for i in wanted), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1)  # sorted, largest first
    for i, row_values, row_ids in zip(wanted, values.tolist(), ids.tolist(), strict=True):
        out[i] = [[v, t, None] for v, t in zip(row_values[: ks[i]], row_ids[: ks[i]], strict=True)]
    return out


def prompt_logprobs(prompt: list[int], start: int, logits: torch.Tensor | None,
                    top: int = 0) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's prompt logprobs from index `start`: `input_token_logprobs`, [[None, prompt[start], None], then
    [logprob, token, None] for each token after it], and with `top` > 0 `input_top_logprobs`, [None, then each of
    those positions' best `top` as [[logprob, token_id, None], ...], best first] (else []). `logits` are a
    prefill's last columns, from the one that predicts prompt[start + 1] on (None: nothing to score); they are
    read in chunks (bounded memory for long prompts)."""
    out: list[list[Any]] = [[None, prompt[start], None]]
    tops: list[list[list[Any]] | None] = [None] if top > 0 else []
    first = start + 1
    if logits is None:
        return out, tops
    for at in range(first, len(prompt), LOGPROB_CHUNK):
        tokens = prompt[at : at + LOGPROB_CHUNK]
        chunk = logits[0, at - first : at - first + len(tokens)].float()
        norm = chunk.logsumexp(dim=-1, keepdim=True)
        targets = torch.tensor(tokens, device=chunk.device)[:, None]
        values = (chunk.gather(1, targets) - norm)[:, 0]
        out += [[value, token, None] for value, token in zip(values.tolist(), tokens, strict=True)]
        if top > 0:
            best, ids = (chunk - norm).topk(min(top, chunk.shape[-1]), dim=-1)
            tops += [[[v, t, None] for v, t in zip(row_values, row_ids, strict=True)]
                     for row_values, row_ids in zip(best.tolist(), ids.tolist(), strict=True)]
    return out, tops


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One U[0,1) draw from each generator (CPU), in row order."""
    return torch.stack([torch.rand((), generator=g) for g in generators])
