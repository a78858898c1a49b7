"""TTT-Discover's entropic advantages for one group of attempts at the same state (pure Python, float64).

Per group of k rewards r: choose β ≥ 0 by bisection so that KL(softmax(β r) ‖ uniform) = log 2, i.e. the
softmax's entropy is log k − log 2; then each attempt's leave-one-out weight is w_i = e_i / ((Σe − e_i)/(k−1))
with e_i = exp(β (r_i − max r)), and its advantage is w_i − 1. An attempt is weighed against the mean of the
others, so the best attempts of a group get large positive advantages and the rest slightly negative ones.

Knows nothing about tokens, models or records. The shift by max r changes no weight (it cancels in the ratio)
and keeps exp from overflowing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TARGET_KL = math.log(2.0)


class GroupError(ValueError):
    """A group the entropic weights cannot be taken on (too small, non-finite, or all rewards equal)."""


def kl_to_uniform(rewards: Sequence[float], beta: float) -> float:
    """KL(softmax(β r) ‖ uniform) = log k − H(softmax(β r)), in nats."""
    top = max(rewards)
    e = [math.exp(beta * (r - top)) for r in rewards]
    total = math.fsum(e)
    q = [x / total for x in e]
    return math.log(len(rewards)) + math.fsum(p * math.log(p) for p in q if p > 0.0)


def beta_for(rewards: Sequence[float], target: float = TARGET_KL, tol: float = 1e-12,
             max_beta: float = 1e12) -> float:
    """The β ≥ 0 with KL(softmax(β r) ‖ uniform) = target, by bisection in float64 (the KL grows with β).

    When even β → ∞ stays below the target (the KL's limit is log k − log(#best), e.g. two distinct rewards with
    target log 2), the search ends at `max_beta`: that is why groups need at least 3 attempts."""
    check(rewards)
    lo, hi = 0.0, 1.0
    while kl_to_uniform(rewards, hi) < target and hi < max_beta:
        lo, hi = hi, hi * 2.0
    hi = min(hi, max_beta)
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if kl_to_uniform(rewards, mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= tol * max(1.0, hi):
            break
    return (lo + hi) / 2.0


def advantages(rewards: Sequence[float], beta: float | None = None) -> tuple[float, list[float]]:
    """(β, advantages): leave-one-out entropic weights minus 1, one per attempt of the group."""
    b = beta_for(rewards) if beta is None else beta
    top = max(rewards)
    e = [math.exp(b * (r - top)) for r in rewards]
    k = len(rewards)
    others = [math.fsum(e[:i] + e[i + 1:]) / (k - 1) for i in range(k)]  # not Σe − e_i: that loses a tiny rest
    if min(others) <= 0.0:  # the others' weights underflowed: β ran to its cap (a group of 2)
        raise GroupError(f"the leave-one-out weights are unbounded at beta {b:.3g}: a group needs at least 3 attempts")
    return b, [x / o - 1.0 for x, o in zip(e, others, strict=True)]


def check(rewards: Sequence[float]) -> None:
    """A group must have at least 2 finite rewards that are not all equal (callers drop equal groups first)."""
    if len(rewards) < 2:
        raise GroupError(f"a group needs at least 2 attempts, got {len(rewards)}")
    if not all(isinstance(r, int | float) and math.isfinite(r) for r in rewards):
        raise GroupError(f"rewards must be finite numbers, got {list(rewards)!r}")
    if max(rewards) == min(rewards):
        raise GroupError("every reward of the group is equal: it has nothing to learn from (drop it)")
