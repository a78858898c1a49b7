"""The trials' decision rule: one-sided t-tests (Welch's, or paired for a shadow) of the difference of two running
tallies, at looks that spend the error (trials.py says the rule in words). Pure arithmetic: no releases, no records."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reefd.config import TrialConfig


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(x: float, df: float) -> float:
    """P(T > x) for Student's t with `df` degrees of freedom, x >= 0."""
    return 0.5 * betainc(df / 2.0, 0.5, df / (df + x * x))


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile (p > 0.5) of Student's t with `df` degrees of freedom."""
    target, lo, hi = 1.0 - p, 0.0, 1.0
    while t_sf(hi, df) > target and hi < 1e12:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_sf(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


@dataclass
class Tally:
    """Count, mean and sum of squared deviations of one side's scores (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"n": self.n, "mean": round(self.mean, 6) if self.n else None,
                "sd": round(math.sqrt(self.var), 6) if self.n > 1 else None}


def look_of(n: int, min_reports: int) -> int | None:
    """The test's look for `n` scores on the smaller side: None before min_reports, then 0, 1, 2 ... at each
    doubling."""
    if n < min_reports:
        return None
    return math.floor(math.log2(n / min_reports) + 1e-12)


def compare(canary: Tally, stable: Tally, cfg: TrialConfig, *, pairs: Tally | None = None) -> dict[str, Any]:
    """The evidence for a decision: both sides, the difference, its interval at this look, and the decision
    (promote, rollback, or None: not yet)."""
    n = pairs.n if pairs is not None else min(canary.n, stable.n)
    look = look_of(n, cfg.min_reports)
    out: dict[str, Any] = {"canary": canary.as_json(), "stable": stable.as_json(), "min_reports": cfg.min_reports,
                           "max_drop": cfg.max_drop, "confidence": cfg.confidence}
    if pairs is not None:
        out["pairs"] = pairs.as_json()
    if look is None:
        return {**out, "decision": None, "reason": f"gathering: {n} of {cfg.min_reports} scores on the smaller side"}
    alpha = (1.0 - cfg.confidence) / 2 ** (look + 1)
    if pairs is not None:
        diff, se, df = pairs.mean, math.sqrt(pairs.var / pairs.n), pairs.n - 1.0
        test = "paired t, one-sided"
    else:
        va, vb = canary.var / canary.n, stable.var / stable.n
        diff, se = canary.mean - stable.mean, math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (canary.n - 1) + vb ** 2 / (stable.n - 1)) if va + vb > 0 else math.inf
        test = "Welch t, one-sided"
    q = t_quantile(1.0 - alpha, df) if se > 0 else 0.0
    lower, upper = diff - q * se, diff + q * se
    if lower > -cfg.max_drop:
        decision, reason = "promote", (f"no worse than the stable release by more than {cfg.max_drop:g}: "
                                       f"lower bound {lower:+.4f}")
    elif upper < -cfg.max_drop:
        decision, reason = "rollback", (f"worse than the stable release by more than {cfg.max_drop:g}: "
                                        f"upper bound {upper:+.4f}")
    else:
        decision, reason = None, (f"undecided at look {look}: the interval [{lower:+.4f}, {upper:+.4f}] holds "
                                  f"-{cfg.max_drop:g}")
    return {**out, "diff": round(diff, 6), "interval": [round(lower, 6), round(upper, 6)],
            "test": {"kind": test, "look": look, "alpha": alpha, "df": None if math.isinf(df) else round(df, 3),
                     "quantile": round(q, 6)},
            "decision": decision, "reason": reason}
