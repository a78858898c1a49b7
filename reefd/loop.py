"""Reef's loop in one place: the resources (each a cleanup context with its typed AppKey) and the edges between
them (callbacks wired here), in the order a turn travels to a hot swap:

    Serve    api/ handlers → Registry (scenarios.py) → engines/      a request takes its scenario's binding
    Observe  RecordStore (records.py)                                records and reports, durable in LMDB
             Retention (retention.py)                                old records deleted, lineage kept
             Conversations (sessions.py) → Judges (judge.py)         next states, judged into reports
    Grow     Scheduler (schedule.py) → Runner (runner.py)            triggers → batch → trainer backend → gate
             Attempts (attempts.py) → Scheduler                      search recipes: a full grid of attempts
             Practice (practice/rounds.py) → engines/, RecordStore   reefd's own answers, verified into reports
             Tinker (tinker/service.py) → trainer processes          a loop of its own drives the trainer
    Commit   commit() below → policy.commit → Reconciler (reconcile.py) → engines/   append, then hot-swap
             Trials (trials.py) → commit()                           a canary or shadow decided by its scores

Handlers read the resources through their AppKeys; the resources call one another only through the edges
wired here: the record store tells the scheduler when a record or report is durable; the admin routes hand a
candidate to `commit`, which writes the chain and has the reconciler swap the engines before anyone is told;
a Grow job does the same in two steps (`write`, then `swap`), so that its records are consumed in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from reefd.commit import policy, proofs
from reefd.commit.chain import Candidate, Release, ReleaseChain, clear_stale_locks
from reefd.commit.chain_types import WeightsRefused
from reefd.commit.reconcile import Reconciler
from reefd.commit.trials import Trials
from reefd.config import ScenarioConfig, ServeConfig
from reefd.engines import trial_replicas
from reefd.grow.attempts import Attempts
from reefd.grow.backends import Backends
from reefd.grow.job_store import JobStore
from reefd.grow.judge import Judges
from reefd.grow.practice.rounds import Practice
from reefd.grow.runner import Runner
from reefd.grow.schedule import Scheduler
from reefd.observe.conversations import Conversations
from reefd.observe.records import RecordStore
from reefd.observe.retention import Retention
from reefd.ops import metrics
from reefd.serve.scenarios import Registry, Scenario
from reefd.tinker.service import Limits, Tinker

log = logging.getLogger("reefd")

STARTED_AT = web.AppKey("started_at", float)
RECORDS = web.AppKey("records", RecordStore)
HTTP = web.AppKey("http", aiohttp.ClientSession)
CHAIN = web.AppKey("chain", ReleaseChain)
REGISTRY = web.AppKey("registry", Registry)
RECONCILER = web.AppKey("reconciler", Reconciler)
CONVERSATIONS = web.AppKey("conversations", Conversations)
JUDGES = web.AppKey("judges", Judges)
RUNNER = web.AppKey("runner", Runner)
SCHEDULER = web.AppKey("scheduler", Scheduler)
ATTEMPTS = web.AppKey("attempts", Attempts)
RETENTION = web.AppKey("retention", Retention)
PRACTICE = web.AppKey("practice", Practice)
TRIALS = web.AppKey("trials", Trials)
TINKER = web.AppKey("tinker", Tinker)
METRICS = web.AppKey("metrics", object)  # a metrics.Metrics, or None without prometheus_client


@dataclass
class Settings:
    """How this daemon runs (flags and environment), as opposed to what it serves (scenarios)."""

    state_dir: Path
    tokens: list[str]  # root tokens: every scope, every scenario
    tokens_file: Path | None = None  # scoped tokens (reefd/ops/tokens.py), re-read on SIGHUP
    records_map_size: int = 1 << 30
    records_whole: bool = False  # REEF_RECORDS=whole: each record one value, as reefd wrote them before pieces
    shutdown_timeout_s: float = 30.0
    scenarios: dict[str, ScenarioConfig] = field(default_factory=dict)
    scenarios_dir: Path = Path("scenarios")  # gate task files and harness folders are relative to it
    max_jobs: int = 1  # Grow jobs running at once, across every scenario
    tinker: Limits = field(default_factory=Limits)  # the Tinker API's sessions and models


SETTINGS = web.AppKey("settings", Settings)


def install(app: web.Application, settings: Settings) -> None:
    """Add the resources to `app`, set up in this order and torn down in the reverse one."""
    app[SETTINGS], app[STARTED_AT] = settings, time.time()
    app[METRICS] = metrics.Metrics(lambda: app[REGISTRY].scenarios) if metrics.prom is not None else None
    app.cleanup_ctx.extend([records, http, chain, engines, conversations, reconciler, grow, practice, retention,
                            tinker])


async def records(app: web.Application) -> AsyncIterator[None]:  # Observe
    settings = app[SETTINGS]
    app[RECORDS] = RecordStore(settings.state_dir / "records", map_size=settings.records_map_size,
                               whole=settings.records_whole)
    await app[RECORDS].open()
    yield
    await app[RECORDS].close()


async def http(app: web.Application) -> AsyncIterator[None]:  # reefd's client of engines and providers
    app[HTTP] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                                      trust_env=False, json_serialize=lambda o: orjson.dumps(o).decode())
    yield
    await app[HTTP].close()


async def chain(app: web.Application) -> AsyncIterator[None]:  # Commit: the append-only release chain
    app[CHAIN] = await asyncio.to_thread(open_chain, app[SETTINGS].state_dir)
    yield


async def engines(app: web.Application) -> AsyncIterator[None]:  # Serve: scenarios bound to engines
    app[REGISTRY] = Registry(app[SETTINGS].scenarios, app[SETTINGS].state_dir, app[HTTP])
    await app[REGISTRY].start()
    yield
    await app[REGISTRY].stop()


async def conversations(app: web.Application) -> AsyncIterator[None]:  # Observe: sessions and next states
    registry = app[REGISTRY]

    def ttl(name: str) -> float:
        scenario = registry.scenarios.get(name)
        return scenario.cfg.serve.session_ttl_s if scenario is not None else ServeConfig.session_ttl_s

    app[CONVERSATIONS] = Conversations(ttl)
    await asyncio.to_thread(reopen_sessions, app[RECORDS], app[CONVERSATIONS], list(registry.scenarios), ttl)
    app[JUDGES] = Judges(registry, app[RECORDS])
    app[CONVERSATIONS].subscribe(app[JUDGES].linked)  # Observe → Observe: a linked turn is judged
    backlog = asyncio.create_task(app[JUDGES].backlog(), name="judge-backlog")
    yield
    backlog.cancel()
    await app[JUDGES].close()


async def reconciler(app: web.Application) -> AsyncIterator[None]:  # Commit → Serve: the declared release
    async def decide(name: str, cand: Candidate) -> Release:  # a trial's decision → Commit
        return await commit(app, app[REGISTRY].get(name), cand)

    app[TRIALS] = Trials(app[RECORDS], app[CHAIN], decide)
    unsubscribe = app[RECORDS].subscribe_reports(app[TRIALS].reported)  # Observe → trial: scores
    app[RECONCILER] = Reconciler(app[REGISTRY], app[CHAIN], app[SETTINGS].state_dir, app[SETTINGS].scenarios_dir)
    app[RECONCILER].subscribe(  # Serve → trial: what the reconciler bound (a head with other weights: no trial)
        lambda s, head: app[TRIALS].serving(s.name, s.cfg.release, head, on_trial=s.trial is not None))
    app[RECONCILER].start()
    yield
    unsubscribe()
    await app[TRIALS].close()
    await app[RECONCILER].stop()


async def grow(app: web.Application) -> AsyncIterator[None]:  # Grow: triggers → jobs → candidates → commit
    settings, state = app[SETTINGS], app[SETTINGS].state_dir
    jobs = await asyncio.to_thread(JobStore, state / "jobs")

    async def write_candidate(scenario: Scenario, cand: Candidate) -> Release:  # Grow → Commit
        return await write(app, scenario, cand, keep_refused=True)

    async def swap_to(scenario: Scenario, user: str | None = None) -> None:  # Commit → Serve
        await swap(app, scenario, user)

    app[RUNNER] = Runner(app[REGISTRY], app[RECORDS], app[CHAIN], jobs, settings.scenarios_dir,
                         Backends(state / "jobs", settings.max_jobs), write_candidate, swap_to,
                         app[RECONCILER].users)
    app[SCHEDULER] = Scheduler(app[REGISTRY], app[RECORDS], jobs, app[RUNNER], max_jobs=settings.max_jobs)
    unsubscribe = app[RECORDS].subscribe(app[SCHEDULER].check)  # Observe → Grow: count triggers
    await app[SCHEDULER].start()
    # Observe → Grow for search recipes: a full grid of attempts submits its job
    app[ATTEMPTS] = Attempts(state / "attempts", app[REGISTRY], app[RECORDS], jobs, app[SCHEDULER].submit)
    await app[ATTEMPTS].start()
    app[RUNNER].prewarm()
    yield
    unsubscribe()
    await app[SCHEDULER].stop()
    await app[RUNNER].close()


async def practice(app: web.Application) -> AsyncIterator[None]:  # Grow: reefd's own verified experience
    app[PRACTICE] = Practice(app[REGISTRY], app[RECORDS], app[RUNNER].jobs, app[SETTINGS].scenarios_dir,
                             app[SETTINGS].state_dir)
    app[PRACTICE].sync()  # rounds (records and reports → Observe → count triggers) on idle engine turns
    yield
    await app[PRACTICE].close()


async def retention(app: web.Application) -> AsyncIterator[None]:  # Observe: records bounded, lineage kept
    app[RETENTION] = Retention(app[REGISTRY], app[RECORDS], app[CHAIN], app[RUNNER].jobs)
    unsubscribe = app[RECORDS].subscribe(app[RETENTION].written)
    app[RETENTION].start()
    yield
    unsubscribe()
    await app[RETENTION].stop()


async def tinker(app: web.Application) -> AsyncIterator[None]:  # Grow: loops that bring their own (Tinker API)
    # Grow → Grow: a checkpoint a loop saves for its sampler goes to the line's gate as a candidate
    app[TINKER] = Tinker(app[SETTINGS].state_dir, app[SETTINGS].tinker, offer=app[SCHEDULER].offer)
    await app[TINKER].start()
    yield
    await app[TINKER].stop()


def reopen_sessions(store: RecordStore, conversations: Conversations, scenarios: list[str],
                    ttl: Callable[[str], float]) -> None:
    """The turns still open after a restart: each scenario's records of its last session_ttl_s."""
    now = time.time()
    for name in scenarios:
        records = store.recent(name, now - ttl(name))
        for record in records:
            conversations.restore(name, record)
        if records:
            log.info("%s: reopened the sessions of %d recent records", name, len(records))


def scrape_state(app: web.Application) -> metrics.State:
    """A snapshot of what a metrics scrape reads, taken on the event loop (the scrape then runs in a thread)."""
    registry = app[REGISTRY]
    scenarios = dict(registry.scenarios)
    lines = {name: line.describe() for name, s in scenarios.items()
             if (line := registry.admissions.get(id(s.engine))) is not None}
    m = of(app)
    practice = {name: found for name in scenarios if (found := app[PRACTICE].status(name)) is not None}
    return metrics.State(scenarios, lines, {name: s.engine.describe() for name, s in scenarios.items()},
                         app[RECORDS].counts, app[RECORDS].path, [copy.copy(j) for j in app[RUNNER].jobs.list()],
                         copy.deepcopy(m.turns) if m is not None else None, practice)


def of(app: web.Application) -> metrics.Metrics | None:
    found = app.get(METRICS)
    return found if isinstance(found, metrics.Metrics) else None


def open_chain(state: Path) -> ReleaseChain:
    """The chain at STATE/releases.git, with what a killed run left behind cleared: stale head locks (reefd is
    the chain's only writer) and unfinished uploads and materialized adapters (rebuilt from the chain)."""
    chain = ReleaseChain(state / "releases.git")
    for lock in clear_stale_locks(chain.path):
        log.warning("removed a stale release lock left by a killed writer: %s", lock)
    for stale in [*(chain.path / "lfs" / "tmp").iterdir(), state / "serving"]:
        if stale.is_dir():
            shutil.rmtree(stale, True)
        else:
            stale.unlink(missing_ok=True)
    return chain


async def write(app: web.Application, scenario: Scenario, cand: Candidate, *, keep_refused: bool = False) -> Release:
    """The chain's commit policy (policy.commit) with the scenario's release settings, off the event loop. Full
    weights the scenario's engine cannot serve are refused first (WeightsRefused): nothing is written."""
    if cand.kind == "weights" and cand.artifact is not None and \
            (why := await asyncio.to_thread(scenario.weights_refusal, cand.artifact)) is not None:
        raise WeightsRefused(scenario.name, why)
    m = of(app)
    await proofs.stamp(app[RECONCILER].files.proofs.reference, cand, scenario.cfg.release.proof, scenario.engine)
    with m.timed(m.publish, scenario.name) if m is not None else contextlib.nullcontext():
        trials = app.get(TRIALS)

        def trial(head: Release | None, c: Candidate) -> dict[str, Any]:  # a canary or shadow starts or is decided
            return trials.meta_for(scenario.name, scenario.cfg.release, head, c, trial_replicas(scenario.engine)) \
                if trials is not None and c.user is None else {}  # trials are the shared line's

        return await asyncio.to_thread(policy.commit, app[CHAIN], scenario.name, cand,
                                       pin=scenario.cfg.release.pin, on_conflict=scenario.cfg.release.on_conflict,
                                       keep_refused=keep_refused, trial=trial)


async def swap(app: web.Application, scenario: Scenario, user: str | None = None) -> None:
    """The reconciler's hot swap to what the chain now declares for `scenario` (or for `user`'s line: their
    later turns page the new head in)."""
    m = of(app)
    with m.timed(m.swap, scenario.name) if m is not None else contextlib.nullcontext():
        if user is not None:
            await app[RECONCILER].users.moved(scenario, user)
        else:
            await app[RECONCILER].reconcile(scenario)


async def commit(app: web.Application, scenario: Scenario, cand: Candidate) -> Release:
    """Commit: `write`, then, for a release, the reconciler's hot swap, so that whoever asked (an operator's
    route) is answered with it already serving."""
    rel = await write(app, scenario, cand)
    if rel.status == "released":
        await swap(app, scenario, cand.user)
    return rel


async def reload(app: web.Application, configs: dict[str, ScenarioConfig]) -> None:
    """SIGHUP: apply a re-read scenario folder. New engines get their releases before routes move to them, every
    scenario is reconciled against its (possibly new) file, triggers are declared again and trainers readied."""
    await app[REGISTRY].reload(configs, bind=app[RECONCILER].bind)
    for name in set(app[TRIALS].watching()) - set(configs):
        app[TRIALS].forget(name)
    app[RECONCILER].kick_all()
    app[SCHEDULER].sync_triggers()
    app[PRACTICE].sync()
    app[RUNNER].prewarm()
