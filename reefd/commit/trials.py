"""Trials of a new release on live traffic: a canary serves a share of the sessions, a shadow answers a copy of
them; scores of both sides decide, by a one-sided test, whether the release is promoted or rolled back.

A trial is state in the release chain, not in memory. A release whose `release.json` meta carries `canary` (mode,
stable, share, started_at) is on trial while it is the head, the scenario still declares that kind of trial and no
pin: it serves its share and the stable release serves the rest (reconcile.py binds both). A later release ends the
trial: the decision (a promote or a rollback whose meta holds `canary.decision` and the evidence), an operator's
rollback or promote, or a new candidate (which goes on trial against the same stable release). After a restart the
scores are counted again from the records served since the trial started, so it resumes with its counts.

The test. Each side's scores are the metric of the reports on its records (a canary), or the scorer's score of the
served and the shadow answer of each copied turn (a shadow, compared pair by pair). With d the canary's mean minus
the stable's, and [d - q·se, d + q·se] its interval (Welch's t; paired t for a shadow):
- promote when the lower bound is above -max_drop: the new release is no worse than the tolerated drop;
- roll back when the upper bound is below -max_drop: it is worse by more than that;
- otherwise wait for more scores, or for max_age_s (then `on_timeout`).
The test looks when the smaller side first reaches min_reports, then at each doubling of it; look k spends
(1 - confidence) / 2^(k+1) of the error, so a wrong decision over all looks has probability at most 1 - confidence.

Knows the chain's meta, records and reports; nothing about HTTP or engines (the loop wires the commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from reefd import plugins
from reefd.commit.chain import Candidate, HeadConflict, Release, ReleaseChain, ReleaseError, TrialRefused
from reefd.commit.decision import Tally, compare, look_of
from reefd.config import CanaryConfig, ReleaseConfig, ShadowConfig, TrialConfig
from reefd.observe.receipts import receipt_floor
from reefd.observe.records import RecordStore
from reefd.observe.report_store import MAX_SCORE
from reefd.ops.background import Background

log = logging.getLogger("reefd.commit.trials")

MODES = ("canary", "shadow")
PAGE = 500  # records read per transaction when a trial's counts are rebuilt
RETRY_S = 30.0  # a decision that could not be committed is tried again this long after (at the deadline check)
RECOUNT_MARGIN_S = 900.0  # a recount reads from this long before the trial began (turns that waited in the line)


@dataclass(frozen=True)
class Spec:
    """A release on trial, as its release.json and the scenario's current file say."""

    mode: str  # canary | shadow
    release: str  # the release on trial (the chain head)
    stable: str  # the release that serves everyone else
    started_at: float
    cfg: TrialConfig  # the scenario's current settings for that mode

    @property
    def share(self) -> float:
        return self.cfg.share

    @property
    def deadline(self) -> float:
        return self.started_at + self.cfg.max_age_s

    @property
    def metric(self) -> str:
        """What a canary compares (a shadow compares its scorer's scores)."""
        return self.cfg.metric if isinstance(self.cfg, CanaryConfig) else "score"

    @property
    def floor(self) -> str:
        """The first receipt of the trial: the stable release's records from here on are its other side."""
        return receipt_floor(int(self.started_at * 1000))


def settings(release: ReleaseConfig, mode: str) -> TrialConfig:
    return release.canary if mode == "canary" else release.shadow


def declared_mode(release: ReleaseConfig) -> str | None:
    """The trial a scenario's file declares for its new releases (None: they serve everyone at once)."""
    if release.canary.share > 0:
        return "canary"
    if release.shadow.share > 0:
        return "shadow"
    return None


def active(release: ReleaseConfig, head: Release | None) -> Spec | None:
    """The trial the head is on, or None: no trial in its meta, decided, no longer declared, or pinned away."""
    if head is None or release.pin is not None:
        return None
    meta = head.meta.get("canary")
    if not isinstance(meta, dict) or "decision" in meta or not isinstance(meta.get("stable"), str):
        return None
    mode = meta.get("mode")
    if mode not in MODES or declared_mode(release) != mode:
        return None
    return Spec(mode, head.id, meta["stable"], float(meta.get("started_at") or 0.0), settings(release, mode))


def takes(spec_release: str, share: float, session: str | None, sticky: str | None = None,
          stable: str | None = None) -> bool:
    """Whether a turn goes to the release on trial: the side its session's previous turn had, else a hash of the
    session (and of the release, so that each trial draws its own sessions)."""
    if sticky is not None:
        if sticky == spec_release:
            return True
        if sticky == stable:
            return False
    if session is None:
        return False
    digest = hashlib.blake2b(f"{spec_release}\0{session}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < share


def side_of(spec: Spec, record: dict[str, Any]) -> bool | None:
    """The side of a canary a served record is on: True (the release on trial), False (the stable release, served
    since the trial began), or None (neither: another release, older traffic, a shadow or practice record)."""
    if isinstance(record.get("shadow"), dict) or record.get("turn_kind") in ("shadow", "practice"):
        return None  # a shadow copy, or practice (reefd's own answers, verified: never a canary's score)
    if record.get("release") == spec.release:
        return True
    if record.get("release") == spec.stable and str(record.get("id")) >= spec.floor:
        return False
    return None


def metric_of(report: dict[str, Any], metric: str) -> float | None:
    """The report's number for `metric` (score, or metadata.KEY); None when it has none."""
    if metric == "score":
        value = report.get("score")
    else:
        meta = report.get("metadata")
        value = meta.get(metric.partition(".")[2]) if isinstance(meta, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            abs(value) > MAX_SCORE:  # a metadata number outside a score's range is no score
        return None
    return float(value)


@dataclass
class Watch:
    """A trial being counted."""

    spec: Spec
    canary: Tally = field(default_factory=Tally)
    stable: Tally = field(default_factory=Tally)
    pairs: Tally | None = None
    counted: set[str] = field(default_factory=set)  # the reports already in a tally (each counts once)
    paired: set[str] = field(default_factory=set)  # shadow records already in the tallies
    backlog: list[Callable[[], None]] = field(default_factory=list)  # scores that came while the recount ran
    loaded: bool = False
    look: int | None = None
    deciding: bool = False
    timer: asyncio.TimerHandle | None = None

    def evidence(self) -> dict[str, Any]:
        out = compare(self.canary, self.stable, self.spec.cfg, pairs=self.pairs)
        return {"mode": self.spec.mode, "release": self.spec.release, "stable_release": self.spec.stable,
                "share": self.spec.share, "started_at": self.spec.started_at, "max_age_s": self.spec.cfg.max_age_s,
                **({"metric": self.spec.metric} if self.spec.mode == "canary" else {}), **out}

    def then(self, apply: Callable[[], None]) -> None:
        """Apply a score now, or once the recount is done (it may have read the record before the score came)."""
        if self.loaded:
            apply()
        else:
            self.backlog.append(apply)


Decide = Callable[[str, Candidate], Awaitable[Release]]
"""Commits a decision for a scenario (the loop's commit: write, then swap)."""


class Trials:
    """The trials of every scenario whose head is on one: counts scores as they arrive, decides, and commits the
    decision through `decide`."""

    def __init__(self, store: RecordStore, chain: ReleaseChain, decide: Decide,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.chain, self.decide, self.clock = store, chain, decide, clock
        self._watches: dict[str, Watch] = {}
        self._background = Background(log)  # recounts, reports being counted, decisions, shadow copies
        self._shadows: dict[str, int] = {}  # shadow copies in flight, per scenario

    SHADOWS_IN_FLIGHT = 4  # per scenario: beyond it a turn is not copied (a shadow never queues behind traffic)

    def take_shadow_slot(self, scenario: str) -> bool:
        """Whether a turn may be copied to the release on shadow trial now (then free_shadow_slot when done)."""
        if self._shadows.get(scenario, 0) >= self.SHADOWS_IN_FLIGHT:
            return False
        self._shadows[scenario] = self._shadows.get(scenario, 0) + 1
        return True

    def free_shadow_slot(self, scenario: str) -> None:
        self._shadows[scenario] = max(0, self._shadows.get(scenario, 0) - 1)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run `coro` in the background, cancelled when reefd stops."""
        self._background.spawn(coro, name)

    # ------------------------------------------------------------ lifecycle

    def serving(self, scenario: str, release: ReleaseConfig, head: Release, on_trial: bool = True) -> None:
        """The reconciler has made `scenario` serve `head`: on trial beside its stable release (`on_trial`), or to
        everyone (then no trial is watched, whatever the head's meta says)."""
        spec = active(release, head) if on_trial else None
        watch = self._watches.get(scenario)
        if watch is not None and spec is not None and watch.spec.release == spec.release:
            watch.spec = spec  # settings may have changed on reload
            if watch.loaded:
                self._arm(scenario, watch)
            return
        self._drop(scenario)
        if spec is None:
            return
        watch = Watch(spec, pairs=Tally() if spec.mode == "shadow" else None)
        self._watches[scenario] = watch
        self.spawn(self._load(scenario, watch), f"trial-{scenario}")

    def watching(self) -> list[str]:
        """The scenarios with a trial being counted."""
        return list(self._watches)

    def forget(self, scenario: str) -> None:
        """A scenario that is no longer served."""
        self._drop(scenario)

    async def close(self) -> None:
        for name in list(self._watches):
            self._drop(name)
        await self._background.cancel()

    def _drop(self, scenario: str) -> None:
        watch = self._watches.pop(scenario, None)
        if watch is not None and watch.timer is not None:
            watch.timer.cancel()

    async def _load(self, scenario: str, watch: Watch) -> None:
        """Count the scores of the records served since the trial started (a restart resumes with them): into a
        fresh count off the event loop, then taken over here, with what arrived meanwhile applied on top."""
        fresh = await asyncio.to_thread(self._recount, scenario, watch.spec)
        if self._watches.get(scenario) is not watch:
            return
        watch.canary, watch.stable, watch.pairs = fresh.canary, fresh.stable, fresh.pairs
        watch.counted, watch.paired = fresh.counted, fresh.paired
        watch.loaded = True
        for apply in watch.backlog:
            apply()
        watch.backlog.clear()
        n = watch.pairs.n if watch.pairs is not None else min(watch.canary.n, watch.stable.n)
        watch.look = look_of(n, watch.spec.cfg.min_reports)  # tested before the restart: the next look decides
        log.info("%s: %s of %s against %s: %d and %d scores so far", scenario, watch.spec.mode, watch.spec.release,
                 watch.spec.stable, watch.canary.n, watch.stable.n)
        self._arm(scenario, watch)
        self._check(scenario, watch)

    def _recount(self, scenario: str, spec: Spec) -> Watch:
        """The trial's scores, from the store (blocking). Records are read from a little before the trial began,
        since a turn that waited in the engine's line then may have been served on its side."""
        fresh = Watch(spec, pairs=Tally() if spec.mode == "shadow" else None)
        after: str | None = receipt_floor(int((spec.started_at - RECOUNT_MARGIN_S) * 1000))
        while True:
            page = self.store.list_records(scenario, after=after, limit=PAGE)
            for record in page:
                self._count_record(fresh, record)
            if len(page) < PAGE:
                return fresh
            after = page[-1]["id"]

    def _count_record(self, watch: Watch, record: dict[str, Any]) -> None:
        spec = watch.spec
        shadow = record.get("shadow")
        if isinstance(shadow, dict):
            if spec.mode == "shadow" and record.get("release") == spec.release:
                self._pair(watch, str(record.get("id")), shadow.get("served_score"), shadow.get("score"))
            return
        side = side_of(spec, record)
        if spec.mode == "canary" and side is not None:
            for report in record.get("reports") or []:
                self._score(watch, report, side)

    def _score(self, watch: Watch, report: dict[str, Any], on_trial: bool) -> bool:
        value = metric_of(report, watch.spec.metric)
        key = str(report.get("report_id"))
        if value is None or key in watch.counted:
            return False
        watch.counted.add(key)
        (watch.canary if on_trial else watch.stable).add(value)
        return True

    @staticmethod
    def _pair(watch: Watch, receipt: str, served: Any, shadow: Any) -> bool:
        if receipt in watch.paired or \
                not all(isinstance(v, int | float) and math.isfinite(v) for v in (served, shadow)):
            return False
        assert watch.pairs is not None
        watch.paired.add(receipt)
        watch.stable.add(float(served))
        watch.canary.add(float(shadow))
        watch.pairs.add(float(shadow) - float(served))
        return True

    def _arm(self, scenario: str, watch: Watch, at_least: float = 0.0) -> None:
        """A timer for the trial's max_age_s (not sooner than `at_least` seconds from now)."""
        if watch.timer is not None:
            watch.timer.cancel()
        delay = max(at_least, watch.spec.deadline - self.clock())
        watch.timer = asyncio.get_running_loop().call_later(min(delay, 3600.0), self._tick, scenario, watch)

    def _tick(self, scenario: str, watch: Watch) -> None:
        """The trial's timer: check the deadline, and wait again while it is ahead (long ages are checked hourly)."""
        watch.timer = None
        self._check(scenario, watch)
        if self._watches.get(scenario) is watch and not watch.deciding:
            self._arm(scenario, watch)

    # ------------------------------------------------------------ scores

    def reported(self, scenario: str, report: dict[str, Any]) -> None:
        """A report (a client's or the judge's) is durable: count it once, for the side that served the earliest
        record it references on either side (a report that spans both sides is one observation, not one per side;
        the earliest, so that a recount after a restart, which reads records in order, counts it the same)."""
        watch = self._watches.get(scenario)
        if watch is None or watch.spec.mode != "canary":
            return
        if metric_of(report, watch.spec.metric) is None:
            return
        self.spawn(self._count_report(scenario, watch, report), f"trial-report-{scenario}")

    async def _count_report(self, scenario: str, watch: Watch, report: dict[str, Any]) -> None:
        spec = watch.spec

        def earliest_side() -> bool | None:
            for ref in sorted(map(str, report.get("references") or [])):  # receipts sort by time
                record = self.store.get_record(ref)
                if record is not None and (side := side_of(spec, record)) is not None:
                    return side
            return None

        side = await asyncio.to_thread(earliest_side)
        if side is None or self._watches.get(scenario) is not watch:
            return

        def apply() -> None:
            if self._score(watch, report, side):
                self._check(scenario, watch)

        watch.then(apply)

    def shadowed(self, scenario: str, release: str, receipt: str, served: float, shadow: float) -> None:
        """A shadow answer of `release` (record `receipt`) and the served answer it copies were scored."""
        watch = self._watches.get(scenario)
        if watch is None or watch.spec.mode != "shadow" or watch.spec.release != release:
            return

        def apply() -> None:
            if self._pair(watch, receipt, served, shadow):
                self._check(scenario, watch)

        watch.then(apply)

    # ------------------------------------------------------------ decisions

    def _check(self, scenario: str, watch: Watch) -> None:
        if self._watches.get(scenario) is not watch or watch.deciding or not watch.loaded:
            return
        n = watch.pairs.n if watch.pairs is not None else min(watch.canary.n, watch.stable.n)
        look = look_of(n, watch.spec.cfg.min_reports)
        due = look is not None and look != watch.look
        if not due and self.clock() < watch.spec.deadline:
            return
        evidence = watch.evidence()
        decision = None
        if due:
            watch.look = look  # each look is tested once, with the scores it has when the smaller side reaches it
            decision = evidence["decision"]
        if decision is None and self.clock() >= watch.spec.deadline:
            decision = watch.spec.cfg.on_timeout
            evidence = {**evidence, "decision": decision,
                        "reason": f"timed out after {watch.spec.cfg.max_age_s:g} s undecided ({evidence['reason']}); "
                                  f"on_timeout: {decision}"}
        if decision is None:
            return
        watch.deciding = True
        self.spawn(self._commit(scenario, watch, {**evidence, "decision": decision}), f"trial-decide-{scenario}")

    async def _commit(self, scenario: str, watch: Watch, evidence: dict[str, Any]) -> None:
        spec, decision = watch.spec, evidence["decision"]
        c, s = evidence["canary"], evidence["stable"]
        figures = (f"{c['mean'] if c['mean'] is not None else '-'} vs {s['mean'] if s['mean'] is not None else '-'} "
                   f"over {c['n']}/{s['n']} scores")
        kind, done, target = ("promote", "promoted", spec.release) if decision == "promote" else \
            ("rollback", "rolled back", spec.stable)
        cand = Candidate(kind, {"source": "canary", "summary": f"{spec.mode} {done} {spec.release}: {figures}",
                                "canary": evidence}, target=target, built_on=spec.release, exact=True)
        try:
            rel = await self.decide(scenario, cand)
            log.info("%s: %s: %s; release %s (%s)", scenario, spec.mode, decision, rel.id, evidence["reason"])
        except (HeadConflict, ReleaseError) as exc:  # the head moved (a new candidate, an operator): no decision
            log.info("%s: the %s of %s ended without a decision: %s", scenario, spec.mode, spec.release, exc)
        except Exception:
            log.exception("%s: the %s of %s could not be decided; trying again at the next look or deadline check",
                          scenario, spec.mode, spec.release)
        finally:
            watch.deciding = False
            if self._watches.get(scenario) is watch:  # not decided after all: the deadline is checked again later
                self._arm(scenario, watch, at_least=RETRY_S)

    # ------------------------------------------------------------ what the chain and status read

    def describe(self, scenario: str) -> dict[str, Any] | None:
        watch = self._watches.get(scenario)
        if watch is None:
            return None
        return {**watch.evidence(), "age_s": round(self.clock() - watch.spec.started_at, 3),
                "loaded": watch.loaded, "deciding": watch.deciding}

    def meta_for(self, scenario: str, release: ReleaseConfig, head: Release | None, cand: Candidate,
                 replicas: int = 1) -> dict[str, Any]:
        """release.json's `canary` for a candidate about to be appended on `head` (blocking: reads the chain):
        - a trial's own decision: as the trial wrote it;
        - an operator's rollback, or promote of the release on trial (or of its stable release: a rollback): that
          decision, with the evidence so far;
        - a new adapter, harness or weights release, or a promote, when the file declares a trial: the start of
          its trial (against the head, or, when the head is itself on trial, against the same stable release).
          Full weights other than the head's go on trial only where the engine hosts one (`replicas`, those of a
          WeightTrial engine: two or more); new weights are refused elsewhere (TrialRefused), a promote of other
          weights serves everyone."""
        if cand.meta.get("source") == "canary" or cand.applies_pin or head is None:
            return {}
        current = active(release, head)
        watch = self._watches.get(scenario) if current is not None else None
        evidence = watch.evidence() if watch is not None and watch.spec.release == head.id else {}  # so far
        if current is not None and cand.kind in ("rollback", "promote") and \
                (cand.kind == "rollback" or cand.target in (head.id, current.stable)):
            decision = "promote" if cand.kind == "promote" and cand.target == head.id else "rollback"
            return {"canary": {**evidence, "mode": current.mode, "release": head.id, "stable_release": current.stable,
                               "decision": decision, "reason": "decided by an operator"}}
        mode = declared_mode(release)
        trialled = ("adapter", "bundle", "harness", "promote", "weights")
        if mode is None or release.pin is not None or cand.kind not in trialled:
            return {}
        if cand.kind == "weights" and replicas < 2:
            raise TrialRefused(scenario, mode, replicas)
        if cand.kind == "promote" and cand.target is not None and replicas < 2:
            with contextlib.suppress(ReleaseError):
                if self.chain.artifacts(cand.target).get("weights") != self.chain.artifacts(head.id).get("weights"):
                    return {}  # other weights: one engine serves one set of weights, so no trial
        cfg = settings(release, mode)
        trial: dict[str, Any] = {"mode": mode, "stable": current.stable if current is not None else head.id,
                                 "started_at": self.clock(), "share": cfg.share, "min_reports": cfg.min_reports,
                                 "max_drop": cfg.max_drop, "confidence": cfg.confidence,
                                 "max_age_s": cfg.max_age_s, "on_timeout": cfg.on_timeout}
        if isinstance(cfg, ShadowConfig):
            trial["scorer"] = cfg.scorer
        else:
            trial["metric"] = release.canary.metric
        if current is not None:
            trial["supersedes"] = {"release": head.id, **evidence}
        return {"canary": trial}


def scorer(cfg: ShadowConfig) -> Callable[[dict[str, Any]], float]:
    """The shadow scorer the scenario names (checked when the file loaded)."""
    fn: Callable[[dict[str, Any]], float] = plugins.resolve({}, str(cfg.scorer), "shadow scorer")
    return fn
