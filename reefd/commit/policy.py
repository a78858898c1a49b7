"""`commit`, the one function through which every release is written: gate verdicts, a moved head followed or
refused, refused candidates kept. Knows the chain's writes; nothing about HTTP, engines, gates or training.
Blocking: callers on an event loop run it in a thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reefd.commit.chain import (
    COPIES,
    BaseMismatch,
    Candidate,
    HeadConflict,
    Pinned,
    Release,
    ReleaseChain,
    TrialRefused,
    plan,
)

REBASE_ATTEMPTS = 5  # on_conflict: rebase follows a moving head this many times at most, for every caller


Trial = Callable[[Release | None, Candidate], dict[str, Any]]
"""What a release policy adds to a candidate's meta, given the head it is appended on (trials.py: a trial)."""


def commit(chain: ReleaseChain, scenario: str, cand: Candidate, *, pin: str | None, on_conflict: str,
           keep_refused: bool = False, trial: Trial | None = None) -> Release:
    """Append `cand` to the scenario's chain (its shared line, or `cand.user`'s): the whole commit policy, for
    every caller (the publish, rollback and promote routes, Grow jobs, the reconciler's base release and pin).

    - A verdict goes into release.json as meta["gate"]; a failed one is kept as a rejected candidate, never served.
    - `plan`: the pin, the head, a copy's target.
    - The head moves by compare-and-swap on the head the candidate was built on. If another writer moved it
      meanwhile and `on_conflict` is "rebase" (and the candidate is not `exact`), the candidate is appended on the
      new head instead (meta: rebased_from, built_on), at most REBASE_ATTEMPTS times; else it is refused.
    - A refusal (Pinned, or HeadConflict) raises; with `keep_refused` the candidate is kept as rejected instead,
      with meta["refused"] saying why, and returned (status "rejected").
    - `trial` adds to the meta of what is appended, given the head it is appended on (a canary's start).
    """
    meta = {**cand.meta, "gate": cand.verdict} if cand.verdict is not None else dict(cand.meta)
    built_on = cand.built_on
    if cand.verdict is not None and cand.verdict.get("verdict") != "pass":
        return _keep(chain, scenario, cand, built_on, meta)
    try:
        head = plan(chain, scenario, cand, pin=pin).head
        if not cand.exact:
            built_on = built_on or (head.id if head is not None else None)
        for attempt in range(1, REBASE_ATTEMPTS + 1):
            try:
                extra = trial(chain.get(built_on) if built_on else None, cand) if trial is not None else {}
                return _append(chain, scenario, cand, built_on, {**meta, **extra})
            except HeadConflict as exc:
                if cand.exact or on_conflict != "rebase" or exc.actual is None or attempt == REBASE_ATTEMPTS:
                    raise
                meta = {**meta, "rebased_from": meta.get("rebased_from", built_on)}
                built_on = exc.actual
        raise AssertionError("unreachable")
    except (Pinned, HeadConflict, BaseMismatch, TrialRefused) as exc:
        if not keep_refused or cand.kind in COPIES:
            raise
        why = (f"the scenario is pinned to {exc.pin}" if isinstance(exc, Pinned)
               else str(exc) if isinstance(exc, BaseMismatch | TrialRefused)
               else f"the head moved to {exc.actual} while the candidate was built")
        return _keep(chain, scenario, cand, cand.built_on, {**meta, "refused": why})


def _append(chain: ReleaseChain, scenario: str, cand: Candidate, built_on: str | None, meta: dict[str, Any]) -> Release:
    if cand.kind == "rollback":
        return chain.rollback(scenario, cand.target, expected_head=built_on, meta=meta, user=cand.user)
    if cand.kind == "promote":
        assert cand.target is not None
        return chain.promote(scenario, cand.target, expected_head=built_on, meta=meta, user=cand.user)
    if cand.artifact is not None and cand.kind != "base":
        meta = {**meta, "built_on": built_on}
    return chain.publish(scenario, expected_head=built_on, kind=cand.kind, artifact_dir=cand.artifact, meta=meta,
                         folder=cand.folder, user=cand.user)


def _keep(chain: ReleaseChain, scenario: str, cand: Candidate, built_on: str | None, meta: dict[str, Any]) -> Release:
    """A candidate that is not released, kept for the record on the head it was built on (or the head now)."""
    if built_on is None and (head := chain.line_head(scenario, cand.user)) is not None:
        built_on = head.id
    if cand.artifact is not None:
        meta = {"built_on": built_on, **meta}
    return chain.reject(scenario, built_on=built_on, kind=cand.kind, artifact_dir=cand.artifact, meta=meta,
                        user=cand.user)
