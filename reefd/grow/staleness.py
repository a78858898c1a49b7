"""Staleness: how many releases a scenario's chain head is ahead of the release that produced a sample (by seq; a
release not in the chain is infinitely stale), and what `max_staleness` does with the samples past it (drop or
weight). Knows release ids and seqs; nothing about records, jobs or training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reefd.grow.recipes import Policy, RecipeError, Sample

if TYPE_CHECKING:
    from reefd.commit.chain import Release

STALE = ("drop", "weight")


@dataclass
class StalenessParams:
    """The staleness settings a weight recipe's params take (recipe.params.max_staleness, stale, stale_clip)."""

    max_staleness: int | None = field(default=None, metadata={
        "minimum": 0, "description": "How many releases behind the chain head a sample may be (0: only samples "
                                     "the head served); null: no limit."})
    stale: str = field(default="drop", metadata={
        "enum": list(STALE), "description": "A sample older than max_staleness: drop (consumed, never trained) or "
                                            "weight (trained, importance-weighted against the logprobs the "
                                            "engine recorded)."})
    stale_clip: float = field(default=2.0, metadata={
        "minimum": 1, "description": "With stale: weight, the bound on a stale token's importance ratio "
                                     "(truncated importance sampling)."})

    def policy(self, weighs: bool = True) -> Policy:
        """The recipe's Policy; RecipeError for `stale: weight` when its objective cannot weight (`weighs`)."""
        if self.stale == "weight" and not weighs:
            raise RecipeError("recipe.params.stale: weight needs an objective that importance-weights samples, and "
                              "this recipe's does not; use drop")
        return Policy(self.max_staleness, self.stale)


def behind(history: Sequence[Release], head: Release) -> dict[str, int]:
    """Release id -> how many releases `head` is ahead of it, for every release of the chain `history` (newest
    first, from a head that may have moved on past `head`: a newer release counts as 0)."""
    return {r.id: max(0, head.seq - r.seq) for r in history}


def past(staleness: int | None, limit: int | None) -> bool:
    """Whether a sample `staleness` releases behind (None: its release is not in the chain) is older than `limit`."""
    return limit is not None and (staleness is None or staleness > limit)


@dataclass
class Aged:
    """A job's eligible samples by staleness: each receipt's release and staleness, and the receipts dropped."""

    policy: Policy
    releases: dict[str, str | None] = field(default_factory=dict)
    ages: dict[str, int | None] = field(default_factory=dict)  # None: the release is not in the chain
    dropped: list[str] = field(default_factory=list)

    def mark(self, samples: list[Sample]) -> list[Sample]:
        """`samples` (a job's batch) with their release and staleness, and `stale` where they are kept past
        max_staleness to be weighted."""
        out = []
        for s in samples:
            if s.receipt in self.ages:
                age = self.ages[s.receipt]
                s = dataclasses.replace(s, release=self.releases[s.receipt], staleness=age,
                                        stale=past(age, self.policy.max_staleness))
            out.append(s)
        return out

    def summary(self, samples: list[Sample]) -> dict[str, Any]:
        """What `reefctl jobs` shows of a batch: min, max and mean staleness of its samples whose release is in
        the chain (None without any), `off_chain` samples from releases that are not, `dropped` samples past
        max_staleness (consumed, not trained), `weighted` ones kept past it, and the `limit`."""
        ages = [self.ages.get(s.receipt) for s in samples]
        known = [a for a in ages if a is not None]
        return {"min": min(known) if known else None, "max": max(known) if known else None,
                "mean": round(sum(known) / len(known), 3) if known else None,
                "off_chain": len(ages) - len(known), "dropped": len(self.dropped),
                "weighted": sum(1 for s in samples if s.stale), "limit": self.policy.max_staleness}


def age(samples: list[Sample], behind: Mapping[str, int], policy: Policy) -> tuple[list[Sample], Aged]:
    """The samples a batch may be chosen from (in order), and what was found: every sample's staleness, and those
    past max_staleness dropped (with `stale: drop`)."""
    aged = Aged(policy)
    kept = []
    for s in samples:
        staleness = behind.get(s.release) if s.release is not None else None
        aged.releases[s.receipt], aged.ages[s.receipt] = s.release, staleness
        if policy.stale == "drop" and past(staleness, policy.max_staleness):
            aged.dropped.append(s.receipt)
        else:
            kept.append(s)
    return kept, aged
