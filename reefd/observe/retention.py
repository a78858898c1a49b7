"""Retention: each scenario's records bounded by its `retention:` (max_age_days, max_records), deleted in bounded
batches off the event loop, soon after writes past max_records and at every sweep interval.

Owns the policy: which records are old or beyond the count, and which are never deleted: the lineage of the
scenario's published releases (the receipts their release.json lists, a rollback's or promote's target's too)
and the batch of its queued or running job. How a record leaves every index is the store's
(RecordStore.delete_records). Knows nothing of HTTP, engines or recipes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from reefd.commit.chain_types import Release, ReleaseError
from reefd.config import RetentionConfig, ScenarioConfig
from reefd.observe.records import RecordStore, StorageError
from reefd.ops.background import Background

log = logging.getLogger("reefd.observe.retention")

DAY_S = 86_400.0


# What retention reads of the other stages, as they declare it (loop.py hands it the scenario registry, the
# release chain and the job store): observe imports none of them.


class Configured(Protocol):
    @property
    def cfg(self) -> ScenarioConfig: ...


class Scenarios(Protocol):
    """The scenarios whose records are bounded, and each one's config (reefd/serve/scenarios.py's Registry)."""

    @property
    def scenarios(self) -> Mapping[str, Configured]: ...


class Lines(Protocol):
    """The release lines whose lineage is kept (reefd/commit/chain.py's ReleaseChain; ReleaseError when unread)."""

    def users(self, scenario: str) -> list[str]: ...

    def history(self, scenario: str, *, user: str | None = None) -> Sequence[Release]: ...

    def head(self, scenario: str, user: str | None = None) -> Release | None: ...


class Batch(Protocol):
    @property
    def receipts(self) -> Sequence[str]: ...

    @property
    def skipped(self) -> Sequence[str]: ...


class ActiveJobs(Protocol):
    """The queued and running jobs, whose batches are kept (reefd/grow/job_store.py's JobStore)."""

    def all_active(self, scenario: str) -> Sequence[Batch]: ...


def lineage(chain: Lines, scenario: str) -> frozenset[str]:
    """The receipts the scenario's published releases learned from, its users' lines' included (blocking: it
    reads the chain)."""
    out: set[str] = set()
    for user in [None, *chain.users(scenario)]:
        for rel in chain.history(scenario, user=user):
            receipts_of(rel.meta, out)
    return frozenset(out)


def receipts_of(meta: dict[str, Any], out: set[str]) -> None:
    receipts = meta.get("receipts")
    if isinstance(receipts, list):
        out.update(r for r in receipts if isinstance(r, str))
    target = meta.get("target_meta")  # a rollback or promote: what its target learned from
    if isinstance(target, dict):
        receipts_of(target, out)


class Retention:
    BATCH = 250  # records per write transaction: ~12 ms of the writer, what a write may wait (bench/retention.py)
    INTERVAL_S = 3600.0  # every scenario is swept this often (and once at start), for max_age_days
    AFTER_WRITES_S = 1.0  # a scenario past max_records is swept this long after a write (debounced)

    def __init__(self, registry: Scenarios, store: RecordStore, chain: Lines, jobs: ActiveJobs) -> None:
        self.registry, self.store, self.chain, self.jobs = registry, store, chain, jobs
        self.deleted: dict[str, int] = {}  # scenario -> records deleted since start
        self._lineage: dict[str, tuple[str | None, frozenset[str]]] = {}  # scenario -> (head commit, receipts)
        self._locks: dict[str, asyncio.Lock] = {}
        self._queued: set[str] = set()
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._background = Background(log)  # the periodic sweep, and sweeps soon after writes

    def start(self) -> None:
        self._background.spawn(self._periodic(), "retention")

    async def stop(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        await self._background.cancel()

    def policy(self, scenario: str) -> RetentionConfig | None:
        s = self.registry.scenarios.get(scenario)
        cfg = s.cfg.retention if s is not None else None
        return cfg if cfg is not None and (cfg.max_age_days is not None or cfg.max_records is not None) else None

    # ------------------------------------------------------------ when

    def written(self, scenario: str) -> None:
        """The store's listener: a record or report of `scenario` is durable. A scenario with max_records is swept
        soon (debounced), so its count stays near the bound between sweeps."""
        cfg = self.policy(scenario)
        if cfg is None or cfg.max_records is None or scenario in self._pending:
            return
        self._pending[scenario] = asyncio.get_running_loop().call_later(self.AFTER_WRITES_S, self._kick, scenario)

    def _kick(self, scenario: str) -> None:
        self._pending.pop(scenario, None)
        if scenario not in self._queued:  # at most one sweep waiting behind the running one
            self._queued.add(scenario)
            self._background.spawn(self.run(scenario), "retention")

    async def _periodic(self) -> None:
        while True:
            for name in list(self.registry.scenarios):
                await self.run(name)
            await asyncio.sleep(self.INTERVAL_S)

    async def run(self, scenario: str) -> int:
        """Sweep `scenario` once the sweep under way (if any) has ended; a failure is logged, not raised."""
        async with self._locks.setdefault(scenario, asyncio.Lock()):
            self._queued.discard(scenario)
            try:
                return await self.sweep(scenario)
            except (StorageError, ReleaseError, OSError) as exc:
                log.warning("%s: retention could not delete records: %s", scenario, exc)
            except Exception:  # a bug: the next sweep tries again
                log.exception("%s: retention failed", scenario)
            return 0

    # ------------------------------------------------------------ what

    async def sweep(self, scenario: str) -> int:
        """Delete what the scenario's policy no longer keeps, BATCH records per transaction; returns how many."""
        cfg = self.policy(scenario)
        if cfg is None:
            return 0
        before_ms = None if cfg.max_age_days is None else int((time.time() - cfg.max_age_days * DAY_S) * 1000)
        deleted, after = 0, None
        while True:
            async with self.store.selecting(scenario):  # no job takes its batch meanwhile
                running = self._running(scenario)  # before the chain: a job that ends meanwhile has published
                batch, after = await asyncio.to_thread(self._expired, scenario, cfg, before_ms, running, after)
                if batch:
                    deleted += await self.store.delete_records(scenario, batch)
            if after is None:
                break
        if deleted:
            self.deleted[scenario] = self.deleted.get(scenario, 0) + deleted
            log.info("%s: retention deleted %d records", scenario, deleted)
        return deleted

    def _expired(self, scenario: str, cfg: RetentionConfig, before_ms: int | None, running: set[str],
                 after: str | None) -> tuple[list[str], str | None]:
        kept = self._lineage_of(scenario)
        return self.store.expired(scenario, before_ms=before_ms, max_records=cfg.max_records,
                                  keep=kept | running if running else kept, after=after, limit=self.BATCH)

    def _running(self, scenario: str) -> set[str]:
        """The records of the scenario's active jobs (its shared line's, and its users')."""
        return {r for job in self.jobs.all_active(scenario) for r in (*job.receipts, *job.skipped)}

    def _lineage_of(self, scenario: str) -> frozenset[str]:
        """lineage(), read again only when a head of the scenario (its shared line's, or a user's) has moved
        (blocking)."""
        heads = [self.chain.head(scenario, user) for user in [None, *self.chain.users(scenario)]]
        commit = ",".join(h.commit for h in heads if h is not None) or None
        cached = self._lineage.get(scenario)
        if cached is not None and cached[0] == commit:
            return cached[1]
        found = lineage(self.chain, scenario)
        self._lineage[scenario] = (commit, found)
        return found
