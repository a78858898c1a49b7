"""One Grow job as a walk through its stages: batch → candidate → gate → commit. The runner owns the batch, the walk
and the commit (`write`, the chain's commit policy; `swap`, serving it); the job kind of the recipe's product
(reefd/grow/job_kinds) makes and judges the candidate. Never raises out of `run`. Knows nothing about trainers or HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from reefd import plugins
from reefd.commit import gates
from reefd.commit.chain import Candidate, Release, ReleaseChain, ReleaseError
from reefd.commit.gates.memory import ScoreMemory
from reefd.commit.user_lines import UserLines
from reefd.config import ScenarioConfig
from reefd.engines import EngineError, EngineUnavailable
from reefd.grow import staleness
from reefd.grow.backends import Backends
from reefd.grow.job_kinds import JobFailed, JobKind, Made, no_generate, until_ready
from reefd.grow.job_kinds.bundle_job import BundleKind
from reefd.grow.job_kinds.harness_job import HarnessKind, SearchKind
from reefd.grow.job_kinds.weight_job import WeightsKind, serving_key
from reefd.grow.job_store import CANDIDATE, Job, JobStore
from reefd.grow.offers import OFFERED, offered
from reefd.grow.promotion import PROMOTE, promotion_batch
from reefd.grow.recipes import TRAINS, Ages, Recipe, RecipeError, Sample, Unbatched, build
from reefd.observe.records import LOOP_TURNS, RecordStore
from reefd.ops.files import write_json
from reefd.serve.scenarios import Registry, Scenario

log = logging.getLogger("reefd.grow.runner")

Write = Callable[[Scenario, Candidate], Awaitable[Release]]
"""(scenario, candidate) -> the release written by the chain's commit policy: released, or kept as rejected."""

Swap = Callable[[Scenario, str | None], Awaitable[object]]
"""Serve the head of the scenario's shared line (None), or of a user's line, now (the reconciler's hot swap)."""


FAULT_KILL_AT = "REEF_FAULT_KILL_AT"
"""Tests only: reefd kills itself (SIGKILL) on reaching this point of a job: a stage (batch, train, gate,
publish) once it is saved, or `committed`, once the release is written and before the job says so."""


def fault_point(point: str) -> None:
    if os.environ.get(FAULT_KILL_AT) == point:
        log.warning("%s=%s: killing reefd here", FAULT_KILL_AT, point)
        os.kill(os.getpid(), signal.SIGKILL)


async def _ready(made: Made) -> Made:
    return made


def eligible(store: RecordStore, recipe: Recipe, scenario: str, user: str | None = None) -> list[Sample]:
    """The recipe's samples among the records of the scenario's line no candidate consumed yet, oldest first,
    each with the release that served its record (blocking). A user's line learns from that user's records only;
    the shared line from the records that are nobody's."""
    return by_line(store, recipe, scenario, only=(user,)).get(user, [])


def by_line(store: RecordStore, recipe: Recipe, scenario: str,
            only: tuple[str | None, ...] | None = None) -> dict[str | None, list[Sample]]:
    """`eligible` for every line at once (or for the lines in `only`): user (None: the shared line) -> its
    samples (blocking)."""
    lines: dict[str | None, list[Sample]] = {}
    for record in store.unconsumed(scenario):
        if record.get("turn_kind") == LOOP_TURNS:  # a Tinker loop's samples: that loop trains on them itself
            continue
        user = record.get("user") if isinstance(record.get("user"), str) else None
        if only is not None and user not in only:
            continue
        sample = recipe.sample(record, record.get("reports", []))
        if sample is not None:
            lines.setdefault(user, []).append(dataclasses.replace(sample, release=record.get("release")))
    return lines


@contextlib.asynccontextmanager
async def as_served(scenario: Scenario, lines: UserLines, user: str | None) -> AsyncIterator[Scenario]:
    """The scenario as a line serves it: for a user's line, with that user's release as its binding (held
    resident meanwhile; no trial), so that a candidate is made on it and judged against it."""
    if user is None:
        yield scenario
        return
    async with lines.holding(scenario, user) as own:
        yield dataclasses.replace(scenario, binding=own or scenario.binding, trial=None)


MANUAL = ("manual", PROMOTE)  # reasons a job runs on whatever batch there is, ready or not


def gate_of(cfg: ScenarioConfig, user: str | None, scenarios_dir: Path) -> dict[str, Any]:
    """The `gate:` mapping a line's candidates are judged by: a user's own tasks file (`users.tasks`) in place of
    `gate.tasks` where the user has one (blocking stat)."""
    own = cfg.users.tasks_of(user, scenarios_dir) if cfg.users is not None else None
    return cfg.gate if own is None else {**cfg.gate, "tasks": own}


def save_candidate(jobs: JobStore, job: Job, made: Made, key: str) -> None:
    """What a restart needs to gate or publish the candidate again: its kind, meta and folder (blocking)."""
    work = jobs.workdir(job)
    write_json(work / CANDIDATE, {"job_kind": key, "kind": made.kind, "meta": made.meta,
                                  "artifact": str(made.artifact.relative_to(work))})


def saved_candidate(jobs: JobStore, job: Job, kinds: dict[str, JobKind]) -> tuple[Made, str]:
    """The candidate `save_candidate` kept, and its job kind's key (blocking); JobFailed when it is gone."""
    work = jobs.workdir(job)
    try:
        saved = json.loads((work / CANDIDATE).read_text())
        made = Made(saved["kind"], saved["meta"], work / saved["artifact"])
        key = saved["job_kind"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobFailed(f"reefd stopped during the job's {job.stage} stage and its candidate is unreadable: "
                        f"{exc}") from None
    if job.built_on is None or key not in kinds or not made.artifact.exists():
        raise JobFailed(f"reefd stopped during the job's {job.stage} stage and its candidate is gone")
    return made, key


class Runner:
    def __init__(self, registry: Registry, store: RecordStore, chain: ReleaseChain, jobs: JobStore,
                 scenarios_dir: Path, backends: Backends, write: Write, swap: Swap, lines: UserLines) -> None:
        self.registry, self.store, self.chain, self.jobs = registry, store, chain, jobs
        self.scenarios_dir, self.backends = scenarios_dir, backends
        self.write, self.swap = write, swap
        self.lines = lines  # users' own releases: what a user's job is built on and judged against
        self.scores = ScoreMemory(self._meta_of)
        self.cancelling: set[str] = set()  # jobs an operator cancelled: their task's CancelledError is that
        self.weights, harness = WeightsKind(self), HarnessKind(self)
        self.bundles = BundleKind(self, self.weights, harness)
        self.kinds: dict[str, JobKind] = {"weights": self.weights, "harness": harness, "search": SearchKind(self),
                                          "bundle": self.bundles}

    def _meta_of(self, release: str) -> dict[str, Any] | None:
        try:
            return self.chain.get(release, include_rejected=True).meta
        except ReleaseError:
            return None

    def prewarm(self) -> None:
        """Get the trainer backends of the scenarios that train weights ready ahead of their first job."""
        self.backends.prewarm(s.cfg.recipe.backend for s in self.registry.scenarios.values()
                              if s.recipe is not None and s.recipe.produces in TRAINS)

    async def close(self) -> None:
        await self.backends.close()

    async def save(self, job: Job, stage: str | None = None) -> None:
        if stage is not None and job.id in self.cancelling:
            # a cancel that a stage swallowed (an engine being stopped absorbs its CancelledError): honoured at
            # the next stage, and always before anything is written to the chain
            raise asyncio.CancelledError
        job.stage = stage or job.stage
        await asyncio.to_thread(self.jobs.save, job)
        if stage is not None:
            fault_point(stage)

    async def run(self, job: Job) -> None:
        resuming = job.state == "running"  # left running by a stopped reefd (JobStore.recover kept it)
        again = False  # reefd stopped while the job trained here, or gated or published: the next reefd goes on
        try:
            job.state, job.started_at = "running", job.started_at or time.time()
            await self.save(job)
            await (self._resume(job) if resuming else self._run(job))
        except asyncio.CancelledError:
            if job.id in self.cancelling:  # `reefctl cancel`: nothing is published, its records stay eligible
                self.cancelling.discard(job.id)
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                await self.cancelled(job)
            elif job.detachable:  # its trainer runs on its cluster: the next reefd follows it (`_resume`)
                job.error = "reefd stopped while the job trained on its cluster; a restart follows it"
                await asyncio.shield(self.save(job))
                raise
            elif job.stage == "train" and self.jobs.has_batch(job):  # the next reefd trains it again (`_resume`)
                again = True
                job.error = "reefd stopped while the job trained; a restart trains it again on the same batch"
                await asyncio.shield(self.weights.stop(job))
                await asyncio.shield(self.save(job))
                raise
            elif self.jobs.starts_over(job):  # nothing on disk to go on from: the next reefd runs it from the start
                again = True
                job.error = f"reefd stopped during the job's {job.stage} stage; a restart runs it from the start"
                await asyncio.shield(self.save(job))
                raise
            elif job.stage in ("gate", "publish") and self.jobs.has_candidate(job):  # the next reefd goes on
                again = True
                job.error = f"reefd stopped during the job's {job.stage} stage; a restart resumes it on its candidate"
                await asyncio.shield(self.save(job))
                raise
            else:
                job.state, job.error = "failed", "reefd stopped while the job was running"
                await asyncio.shield(self.weights.stop(job))  # a cluster job that would not outlive reefd
                raise
        except (JobFailed, RecipeError, gates.GateError, ReleaseError, EngineError, EngineUnavailable,
                plugins.PluginError, OSError) as exc:
            job.state, job.error = "failed", str(exc) or type(exc).__name__
            log.error("%s %s failed: %s", job.scenario, job.id, job.error)
        except Exception as exc:  # a bug must not take the scheduler down; the job says what happened
            log.exception("%s %s failed", job.scenario, job.id)
            job.state, job.error = "failed", f"internal error: {exc}"
        finally:
            if job.id in self.cancelling:  # cancelled, but the job ended first some other way (not published)
                self.cancelling.discard(job.id)
                if job.state in ("running", "failed", "skipped"):
                    job.state, job.error = "cancelled", f"cancelled during its {job.stage} stage"
            if not (job.state == "running" and (job.detachable or again)):
                await self._close(job)  # else: followed, or trained again, after a restart

    async def cancelled(self, job: Job) -> None:
        """An operator cancelled the job: it is on record as cancelled, and no longer followed after a restart,
        before its trainer is stopped on its cluster, so that nothing can publish it any more (a second cancel,
        or reefd stopping, meanwhile changes nothing)."""
        job.detachable = False
        job.state, job.error = "cancelled", f"cancelled during its {job.stage} stage"
        await asyncio.shield(self.save(job))
        log.info("%s %s: %s", job.scenario, job.id, job.error)
        # on a cluster (whether or not its job outlives reefd); a local trainer stopped with the task
        problem = await asyncio.shield(self.weights.stop(job))
        if problem:
            job.error = f"{job.error}; {problem}"
            log.warning("%s %s: %s", job.scenario, job.id, problem)

    async def _close(self, job: Job) -> None:
        job.finished_at = time.time()
        if job.state == "running":
            job.state = "failed"
        await asyncio.shield(self.save(job))
        if job.state != "failed" or not os.environ.get("REEF_KEEP_FAILED_JOBS"):
            await asyncio.to_thread(shutil.rmtree, self.jobs.workdir(job), True)

    def scenario(self, job: Job) -> Scenario:
        """The scenario as served now (a reload may have replaced its objects since the job started)."""
        scenario = self.registry.scenarios.get(job.scenario)
        if scenario is None:
            raise JobFailed(f"scenario {job.scenario!r} is no longer served")
        return scenario

    async def _run(self, job: Job) -> None:
        if job.reason == OFFERED:  # a candidate offered whole (a Tinker checkpoint): straight to its gate
            return await self._walk(job, "weights", lambda stack: offered(self.chain, self.jobs, job))
        scenario = self.scenario(job)
        recipe = scenario.recipe or build(scenario.cfg.recipe.name, scenario.cfg.recipe.params)  # build: its error
        if recipe.produces == "nothing":
            job.state, job.error = "skipped", f"recipe {job.recipe!r} does not train"
            return
        await self.save(job, "batch")
        head = await asyncio.to_thread(self.chain.line_head, job.scenario, job.user)  # what the job is built on
        async with self.store.selecting(job.scenario):  # retention deletes none of them until job.receipts is set
            whose: dict[str, str] = {}  # a promotion's: receipt -> the user whose release learned from it
            if job.reason == PROMOTE:
                found = await asyncio.to_thread(promotion_batch, job, scenario.cfg.users, self.store, self.chain,
                                                recipe, self.registry.users.sharing(job.scenario))
                if found is None:
                    return
                (samples, whose), aged = found, None
            else:
                samples = await asyncio.to_thread(eligible, self.store, recipe, job.scenario, job.user)
                aged = None
                if recipe.produces in TRAINS and head is not None:
                    samples, aged = await self._aged(job, recipe, head, samples)
            needs_records = not isinstance(recipe, Unbatched) or recipe.needs_records
            if (not samples and needs_records) or (job.reason not in MANUAL and not recipe.ready(samples)):
                job.state = "skipped"
                job.error = f"no batch ready: {len(samples)} eligible scored record(s) waiting"
                if aged is not None and aged.dropped:
                    job.error += f"; {len(aged.dropped)} past max_staleness dropped"
                return
            async with as_served(scenario, self.lines, job.user) as served:
                binding = served.binding
            spec = recipe.candidate(samples, binding.harness if binding is not None else None)
            if aged is not None:
                spec.samples = aged.mark(spec.samples)
                job.staleness, job.skipped = aged.summary(spec.samples), list(aged.dropped)
            job.receipts = [s.receipt for s in spec.samples]
            if whose:  # the users of the records the batch holds
                job.users = sorted({whose[r] for r in job.receipts if r in whose})
        if head is None:
            raise JobFailed("the scenario has no base release yet")
        job.built_on, job.job_kind = head.id, spec.kind
        await self.save(job)
        kind = self.kinds[spec.kind]
        await self._walk(job, spec.kind, lambda stack: kind.make(job, scenario, spec, stack))

    async def _aged(self, job: Job, recipe: Recipe, head: Release, samples: list[Sample]
                    ) -> tuple[list[Sample], staleness.Aged]:
        """The samples a weight job's batch may be chosen from, and each one's staleness behind `head`; those past
        max_staleness with `stale: drop` are consumed now (they only grow staler: the chain never rewinds)."""
        history = await asyncio.to_thread(lambda: self.chain.history(job.scenario, user=job.user)
                                          or self.chain.history(job.scenario))
        policy = recipe.staleness if isinstance(recipe, Ages) else staleness.Policy()
        kept, aged = staleness.age(samples, staleness.behind(history, head), policy)
        if aged.dropped:
            job.staleness = aged.summary([])
            await asyncio.shield(self.store.mark_consumed(job.scenario, aged.dropped, job.id))
            log.info("%s %s: %d sample(s) past max_staleness %s dropped", job.scenario, job.id, len(aged.dropped),
                     policy.max_staleness)
        return kept, aged

    async def _resume(self, job: Job) -> None:
        """A job a stopped reefd left running (`kill -9` included), from the stage it was in: training (on a
        cluster that outlived reefd: follow the same trainer job, found by the job's id, so nothing is trained
        twice; here: train again from the start on the same batch, its spec), gating (the gate again, on the
        candidate it saved), or publishing (the commit, once: a release this job already wrote is taken)."""
        scenario = await self._served(job)
        job.error = None
        if job.stage != "train":
            made, key = await asyncio.to_thread(saved_candidate, self.jobs, job, self.kinds)
            made = self.kinds[key].resumed(scenario, made)
            log.info("%s %s: resuming its %s stage on the candidate it saved, after a restart", job.scenario, job.id,
                     job.stage)
            if job.stage == "gate" or job.verdict is None:
                await self._walk(job, key, lambda stack: _ready(made))
            else:
                await self._publish(job, made, job.verdict, resumed=True)
            return
        spec_path = self.jobs.workdir(job) / "spec.json"
        if job.built_on is None or not spec_path.is_file():
            raise JobFailed("reefd stopped during the job and its files are gone")
        if job.detachable:
            log.info("%s %s: following its trainer job again after a restart", job.scenario, job.id)
        else:
            log.info("%s %s: training again on the same batch after a restart", job.scenario, job.id)
            job.progress, job.metrics = {}, {}
            await asyncio.to_thread(shutil.rmtree, spec_path.parent / "candidate", True)  # what the last run left
        trainer = self.bundles if job.job_kind == "bundle" else self.weights  # a bundle trains beside its proposal
        await self._walk(job, job.job_kind or "weights", lambda stack: trainer.train(job, scenario, spec_path, stack))

    async def _served(self, job: Job) -> Scenario:
        """The job's scenario once its engine is up and the reconciler has served its release after the restart
        (what a resumed candidate is judged against, and the harness it was proposed on)."""
        scenario = self.scenario(job)
        await until_ready(scenario.engine, scenario.cfg.model.startup_timeout_s, "scenario's")
        deadline = time.monotonic() + scenario.cfg.model.startup_timeout_s
        while not (scenario.settled and scenario.binding is not None):
            if time.monotonic() > deadline:
                raise JobFailed(f"the scenario serves no release yet: {scenario.error or 'not reconciled'}")
            await asyncio.sleep(0.25)
            scenario = self.scenario(job)
        return scenario

    async def _walk(self, job: Job, key: str,
                    make: Callable[[contextlib.AsyncExitStack], Awaitable[Made | None]]) -> None:
        """candidate (`make`, by the job kind `key`) → gate → commit."""
        kind = self.kinds[key]
        async with contextlib.AsyncExitStack() as stack:  # what the candidate borrows until its gate
            made = await make(stack)
            if made is None:  # skipped: the job says why
                return
            await asyncio.to_thread(save_candidate, self.jobs, job, made, key)  # a restart gates it again
            await self.save(job, "gate")
            # a user's job is judged against their release
            scenario = await stack.enter_async_context(as_served(self.scenario(job), self.lines, job.user))
            gate = gates.build(await asyncio.to_thread(gate_of, scenario.cfg, job.user, self.scenarios_dir),
                               self.scenarios_dir)
            verdict = await (gate.evaluate(no_generate, current=None, candidate=None) if gate.sampling is None
                             else kind.gate(job, scenario, made, gate))
        await self._publish(job, made, verdict.as_meta())

    async def _publish(self, job: Job, made: Made, verdict: dict[str, Any], resumed: bool = False) -> None:
        job.verdict = verdict
        await self.save(job, "publish")
        assert job.built_on is not None
        meta = {**made.meta, "users": job.users} if job.users else made.meta  # a promotion names its users
        cand = Candidate(made.kind, meta, artifact=made.artifact, built_on=job.built_on, verdict=verdict,
                         user=job.user)
        await self._commit(job, self.scenario(job), cand, resumed)

    def _written(self, job: Job) -> Release | None:
        """The release (or rejected candidate) this job already wrote, by a reefd stopped before it said so."""
        return next((r for r in self.chain.history(job.scenario, include_rejected=True, user=job.user)
                     if r.meta.get("job") == job.id), None)

    async def _commit(self, job: Job, scenario: Scenario, cand: Candidate, resumed: bool) -> None:
        """Write the candidate to the chain (released, or kept as rejected), consume its records (and those the
        recipe skipped), and serve it: the job reports success only once its next answer comes from the new
        release. Exactly once: a job resumed in this stage takes the release it wrote before the restart."""
        written = await asyncio.to_thread(self._written, job) if resumed else None
        rel = written or await self.write(scenario, cand)
        if written is not None:
            log.info("%s %s: its release %s was written before the restart", job.scenario, job.id, rel.id)
        fault_point("committed")
        job.release = rel.id
        if job.reason != PROMOTE:  # a promotion's records already taught their users' lines: nothing to consume
            await asyncio.shield(self.store.mark_consumed(job.scenario, [*job.receipts, *job.skipped], job.id))
        verdict = cand.verdict or {}
        if rel.status == "rejected":
            log.info("%s %s: candidate %s rejected: %s", job.scenario, job.id, rel.id,
                     rel.meta.get("refused") or verdict.get("reason"))
        elif job.user is not None:  # a user's line: their next turn pages the new head in
            await self.swap(scenario, job.user)
            if self.lines.head(job.scenario, job.user) != rel.id:
                job.error = "published, but not the head of the user's line"
        else:
            await self.swap(scenario, None)
            live = self.registry.scenarios.get(job.scenario)
            serving = {b.release: b for b in (live.binding if live is not None else None,
                                              live.trial.binding if live is not None and live.trial else None)
                       if b is not None}
            binding = serving.get(rel.id)  # serving everyone, or on trial as a canary or shadow
            if binding is None:
                job.error = f"published, but not serving yet: {live.error if live else 'scenario removed'}"
            elif cand.kind in ("adapter", "weights"):  # the next gate's current side: scores measured on this
                self.scores.remember(serving_key(binding), verdict.get("fingerprint"),
                                     [p["candidate"] for p in verdict.get("per_task") or ()])
        job.stage = "done"
        job.state = "published" if rel.status == "released" else "rejected"
