"""When Grow jobs run: triggers (record count, debounced after durable records; interval and cron, APScheduler jobs
on the daemon's loop; `reefctl train`), one job per line (a scenario's shared line, and each of its users' lines:
a trigger joins the line's queued or running one), at most max_jobs at once, first come first served. A user's
count trigger counts that user's own eligible records. Since a line has at most one job queued or running and
the queue is first come first served, a user with heavy traffic waits behind every other line that asked
before it: nobody is starved. Running a job is the runner's (reefd/grow/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

from reefd.grow.job_store import Job, JobStore
from reefd.grow.offers import OFFERED, write_offer
from reefd.grow.runner import Runner, by_line
from reefd.observe.records import RecordStore
from reefd.ops.background import Background
from reefd.serve.scenarios import Registry

log = logging.getLogger("reefd.grow.schedule")


def line_key(scenario: str, user: str | None) -> str:
    """One release line's key: the scenario's name, and the user's (neither holds a '/')."""
    return scenario if user is None else f"{scenario}/{user}"


class CannotCancel(Exception):
    """The job has ended, or is writing its release."""


class Scheduler:
    COUNT_DEBOUNCE_S = 0.2
    FAILURE_COOLDOWN_S = 60.0  # a failed or skipped job's records stay eligible: count triggers wait this long

    def __init__(self, registry: Registry, store: RecordStore, jobs: JobStore, runner: Runner,
                 max_jobs: int = 1) -> None:
        self.registry = registry
        self.store = store
        self.jobs = jobs
        self.runner = runner
        self.max_jobs = max_jobs
        self._queue: deque[Job] = deque()
        self._running: dict[str, asyncio.Task[None]] = {}  # line (`line_key`) -> its running job's task
        self._after: dict[str, Job] = {}  # line -> an offered candidate's job, queued once the line's job ends
        self._wake = asyncio.Event()
        self._checks: dict[str, asyncio.TimerHandle] = {}
        self._cooldown: dict[str, float] = {}  # line -> monotonic time before which counts do not fire
        self._background = Background(log)  # the dispatcher and count checks
        self._aps: Any = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for job in await asyncio.to_thread(self.jobs.recover):
            log.warning("%s %s: marked failed: %s", job.scenario, job.id, job.error)
        for job in self.jobs.resumable():  # what a stopped reefd left queued or training runs first
            if job.scenario in self.registry.scenarios:
                self._enqueue(job)
            else:
                job.state, job.error, job.finished_at = "failed", "its scenario is no longer served", time.time()
                await asyncio.to_thread(self.jobs.save, job)
        self._wake.set()
        with warnings.catch_warnings():  # tzlocal's deprecation chatter on import
            warnings.simplefilter("ignore", DeprecationWarning)
            from apscheduler.schedulers.asyncio import AsyncIOScheduler

        self._aps = AsyncIOScheduler(event_loop=asyncio.get_running_loop(), timezone="UTC")
        self._aps.start()
        self.sync_triggers()
        self._background.spawn(self._dispatch(), "dispatch")
        for name in self.registry.scenarios:
            self.check(name)

    async def stop(self) -> None:
        if self._aps is not None:
            self._aps.shutdown(wait=False)
        for handle in self._checks.values():
            handle.cancel()
        await self._background.cancel()  # the dispatcher first: it starts no job after this
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    def sync_triggers(self) -> None:
        """(Re)declare the interval and cron triggers of every scenario (at start and after SIGHUP)."""
        from apscheduler.triggers.cron import CronTrigger
        from apscheduler.triggers.interval import IntervalTrigger

        self._aps.remove_all_jobs()
        for name, scenario in self.registry.scenarios.items():
            trig = scenario.cfg.trigger
            if trig.interval_s is not None:
                self._aps.add_job(self._fire, IntervalTrigger(seconds=trig.interval_s), args=[name, "interval"],
                                  id=f"{name}:interval", coalesce=True, max_instances=1)
            if trig.cron is not None:
                self._aps.add_job(self._fire, CronTrigger.from_crontab(trig.cron, timezone="UTC"),
                                  args=[name, "cron"], id=f"{name}:cron", coalesce=True, max_instances=1)

    async def _fire(self, scenario: str, reason: str) -> None:
        """APScheduler runs coroutines on the daemon's loop (plain functions would run in a thread). On a per-user
        scenario, every user's line with eligible records is submitted too."""
        s = self.registry.scenarios.get(scenario)
        if s is None or s.trial is not None:  # a release on trial is judged before anything replaces it
            return
        await self.submit(scenario, reason)
        if s.cfg.users is not None and s.recipe is not None:
            lines = await asyncio.to_thread(by_line, self.store, s.recipe, scenario)
            for user in sorted(u for u in lines if u is not None):
                await self.submit(scenario, reason, user)

    # ------------------------------------------------------------ triggers

    def check(self, scenario: str) -> None:
        """A record or report arrived: soon, see whether the count trigger fires (debounced)."""
        cfg = self.registry.scenarios.get(scenario)
        if cfg is None or cfg.cfg.trigger.every_n_records is None or scenario in self._checks:
            return
        loop = asyncio.get_running_loop()
        self._checks[scenario] = loop.call_later(self.COUNT_DEBOUNCE_S, self._count, scenario)

    def _count(self, scenario: str) -> None:
        self._checks.pop(scenario, None)
        self._background.spawn(self._count_check(scenario), f"count-check-{scenario}")

    async def _count_check(self, scenario: str) -> None:
        s = self.registry.scenarios.get(scenario)
        if s is None or s.cfg.trigger.every_n_records is None or s.trial is not None:
            return  # (a release on trial is judged before a job may replace it; `reefctl train` still can)
        recipe = s.recipe  # built once per scenario (re)load: a recipe that cannot be built is None
        if recipe is None or recipe.produces == "nothing":
            return
        lines = await asyncio.to_thread(by_line, self.store, recipe, scenario)
        for user, samples in sorted(lines.items(), key=lambda kv: kv[0] or ""):
            if (user is not None and s.cfg.users is None) or self.jobs.active(scenario, user) or \
                    time.monotonic() < self._cooldown.get(line_key(scenario, user), 0.0):
                continue
            if len(samples) >= s.cfg.trigger.every_n_records and recipe.ready(samples):
                await self.submit(scenario, "count", user)

    async def submit(self, scenario: str, reason: str, user: str | None = None) -> Job:
        """Queue a job for the scenario's shared line (or `user`'s), or return the one already queued or running
        on that line (triggers coalesce)."""
        current = self.jobs.active(scenario, user)
        if current is not None:
            return current
        s = self.registry.scenarios[scenario]
        job = self.jobs.new(scenario, reason, s.cfg.recipe.name, user)  # listed now: a trigger meanwhile joins it
        try:
            await asyncio.to_thread(self.jobs.save, job)
        except BaseException:  # not on disk (a full disk, say): it never existed
            self.jobs.jobs.pop(job.id, None)
            raise
        self._queue.append(job)
        log.info("%s %s: queued (%s%s)", scenario, job.id, reason, f", user {user}" if user else "")
        self._wake.set()
        return job

    async def offer(self, scenario: str, user: str | None, folder: Path, meta: dict[str, Any]) -> Job:
        """A candidate made outside a recipe (a Tinker checkpoint's adapter in `folder`, `meta` for its release),
        to be gated for the line: in the offered job already waiting there (the newer candidate takes its place),
        or in a new one, queued now or once the line's current job ends."""
        line = line_key(scenario, user)
        waiting = self._after.get(line) or next((j for j in self._queue if line_key(j.scenario, j.user) == line
                                                 and j.reason == OFFERED), None)
        job = waiting or self.jobs.new(scenario, OFFERED, OFFERED, user)
        try:
            await asyncio.to_thread(write_offer, self.jobs, job, folder, meta)
            await asyncio.to_thread(self.jobs.save, job)
        except BaseException:
            if waiting is None:
                self.jobs.jobs.pop(job.id, None)
            raise
        if waiting is None:
            self._enqueue(job)
            log.info("%s %s: a candidate offered (%s)", scenario, job.id, meta.get("source"))
            self._wake.set()
        return job

    def _enqueue(self, job: Job) -> None:
        """Queue `job`, or hold it (an offered candidate's) while its line has another job queued or running."""
        line = line_key(job.scenario, job.user)
        if line in self._running or any(line_key(j.scenario, j.user) == line for j in self._queue):
            self._after[line] = job
        else:
            self._queue.append(job)

    async def cancel(self, job: Job) -> Job:
        """Stop a queued or running job (`reefctl cancel`): nothing is published, its records stay eligible (count
        triggers wait FAILURE_COOLDOWN_S, so the job does not start again at once). CannotCancel once it has
        ended or is publishing (the release is being written)."""
        if job.state not in ("queued", "running"):
            raise CannotCancel(f"job {job.id} already ended: {job.state}")
        if job.stage in ("publish", "done"):
            raise CannotCancel(f"job {job.id} is publishing its release; it can no longer be cancelled")
        self._cooldown[line_key(job.scenario, job.user)] = time.monotonic() + self.FAILURE_COOLDOWN_S
        if self._after.get(line_key(job.scenario, job.user)) is job:  # held behind its line's job: never started
            self._after.pop(line_key(job.scenario, job.user))
            await self._cancel_unstarted(job)
            return job
        task = self._running.get(line_key(job.scenario, job.user))
        if task is not None and job.id in self.runner.cancelling:  # a cancel under way: wait for it
            await asyncio.wait({task})
            return job
        if job in self._queue or task is None:  # not started (or, after a restart, not followed yet)
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            await self._cancel_unstarted(job)
            return job
        self.runner.cancelling.add(job.id)
        task.cancel()
        await asyncio.wait({task})  # the trainer stopped (SIGTERM, its grace), the job's files removed
        if job.state in ("queued", "running"):  # cancelled before its task ran a line: the runner never saw it
            self.runner.cancelling.discard(job.id)
            if self._running.get(line_key(job.scenario, job.user)) is task:
                self._running.pop(line_key(job.scenario, job.user))
                self._wake.set()
            await self._cancel_unstarted(job)
        return job

    async def _cancel_unstarted(self, job: Job) -> None:
        """A job no task runs (queued, or left training on its cluster by a stopped reefd): cancelled as the
        runner cancels one, and closed."""
        job.finished_at = time.time()
        await self.runner.cancelled(job)
        await asyncio.to_thread(self.jobs.save, job)

    # ------------------------------------------------------------ dispatch

    async def _dispatch(self) -> None:
        """Start queued jobs, oldest first, while fewer than max_jobs run."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and len(self._running) < self.max_jobs:
                job = self._queue.popleft()
                task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
                self._running[line_key(job.scenario, job.user)] = task

    async def _run(self, job: Job) -> None:
        try:
            await self.runner.run(job)
        finally:
            self._running.pop(line_key(job.scenario, job.user), None)
            if (held := self._after.pop(line_key(job.scenario, job.user), None)) is not None:
                self._queue.append(held)  # an offered candidate waited for the line
            self._wake.set()
            # the batch of a failed job, or of a refused proposal, is still eligible: count triggers wait a while
            if job.state in ("failed", "cancelled") or (job.state == "skipped" and job.reason != "manual"):
                self._cooldown[line_key(job.scenario, job.user)] = time.monotonic() + self.FAILURE_COOLDOWN_S
            with contextlib.suppress(RuntimeError):
                self.check(job.scenario)  # rollouts that arrived meanwhile may make the next batch
