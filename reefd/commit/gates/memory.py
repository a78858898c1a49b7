"""The serving side's per-task gate scores, kept so that the next gate need not generate them again
(`reuse_current`): what this process measured, keyed by adapter tree and gate fingerprint, else the `candidate`
column of the gate that admitted the serving release, read from its release.json (for a rollback or promote,
from the release it copies).

Knows verdict records (release.json's meta["gate"]); it reads release metadata through a callback, and knows
nothing about the chain, engines or scenarios.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MetaOf = Callable[[str], dict[str, Any] | None]
"""(release id) -> its release.json meta, or None when there is no such release."""


class ScoreMemory:
    KEPT = 64

    def __init__(self, meta_of: MetaOf) -> None:
        self.meta_of = meta_of
        self._scores: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def remember(self, key: str | None, digest: str | None, scores: list[float | None]) -> None:
        """Per-task means measured for the side `key` (an adapter's tree id, or "base") under `digest`; a side
        with an unscored task is not kept."""
        if key is None or digest is None or any(x is None for x in scores):
            return
        self._scores[(key, digest)] = [float(x) for x in scores if x is not None]
        self._scores.move_to_end((key, digest))
        while len(self._scores) > self.KEPT:
            self._scores.popitem(last=False)

    def known(self, key: str, release: str | None, digest: str) -> list[float] | None:
        """The side's per-task means under `digest`: remembered, else admitted with `release` (None: the side has
        no release of its own to look in, e.g. the base model). Blocking when it reads release metadata."""
        found = self._scores.get((key, digest))
        if found is not None or release is None:
            return found
        meta = self.meta_of(release) or {}
        for doc in (meta, meta.get("target_meta") or {}):
            gate = doc.get("gate") if isinstance(doc, dict) else None
            if isinstance(gate, dict) and gate.get("fingerprint") == digest and gate.get("per_task"):
                scores = [p.get("candidate") for p in gate["per_task"] if isinstance(p, dict)]
                numbers = [float(x) for x in scores if isinstance(x, int | float)]
                if len(numbers) == len(gate["per_task"]):
                    return numbers
        return None
