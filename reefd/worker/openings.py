"""What a prefill group of prompts has in common: the opening every prompt shares (a chat template's system prompt,
a task family's fixed words) and the prompts asked more than once (a task's k samples).

The model runs the opening once, at batch 1, and each distinct prompt's rest once, attending to the opening's keys
and values; a prompt asked k times gets k copies of its cache rows. Within one prefill only: the worker keeps no
prefix cache across requests, so nothing here outlives the call. Pure Python; knows nothing about torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_SHARED = 8  # a shorter opening is not worth a second forward call


@dataclass(frozen=True)
class Plan:
    """A group's prefill as an opening and distinct rests."""

    opening: list[int]  # the tokens every prompt starts with, run once
    rests: list[list[int]]  # each distinct prompt after the opening (never empty)
    rows: list[int]  # for each prompt of the group, the index of its rest


def plan(prompts: Sequence[Sequence[int]], adapters: Sequence[str | None] | None) -> Plan | None:
    """How to prefill `prompts` sharing what they share, or None when the plain padded prefill is as good: one
    prompt, rows on different adapters (an opening's keys and values depend on the adapter), or under
    MIN_SHARED tokens in common and no prompt asked twice."""
    if len(prompts) < 2 or (adapters is not None and len(set(adapters)) > 1):
        return None
    shared = _common_length(prompts)
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    if shared < MIN_SHARED:
        if len(distinct) == len(prompts):
            return None
        shared = 0  # no opening, but each repeated prompt runs once
    return Plan(list(prompts[0][:shared]), [list(p[shared:]) for p in distinct], rows)


def _common_length(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the prompts' common opening, leaving every prompt at least its last token (whose output
    predicts the first new token)."""
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n
