"""The scheduler alone, with a job runner that only records what it is asked to run: cron triggers on a clock the
test controls, and REEF_MAX_JOBS across scenarios, first come first served."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reefd.grow.job_store import CANDIDATE, Job, JobStore
from reefd.grow.schedule import Scheduler, line_key


def scenario(cron: str | None = None) -> Any:
    trigger = SimpleNamespace(interval_s=None, cron=cron, every_n_records=None)
    return SimpleNamespace(cfg=SimpleNamespace(trigger=trigger, recipe=SimpleNamespace(name="sao")), recipe=None,
                           trial=None)


class Runner:
    """Runs a job until the test lets it finish."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finish: dict[str, asyncio.Event] = {}
        self.cancelling: set[str] = set()

    async def run(self, job: Job) -> None:
        self.started.append(job.scenario)
        job.state = "running"
        await self.finish.setdefault(job.scenario, asyncio.Event()).wait()
        job.state = "done"


async def until(check: Any) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_cron_trigger_fires_when_the_clock_reaches_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trigger.cron: "0 3 * * *"`: nothing at 02:59, a job (reason cron) once the clock passes 03:00 UTC."""
    import apscheduler.executors.base as aps_executors
    import apscheduler.schedulers.base as aps_base

    now = [dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.UTC)]

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:  # APScheduler 3 reads the time in these two modules only
            return now[0].astimezone(tz)

    monkeypatch.setattr(aps_base, "datetime", Clock)
    monkeypatch.setattr(aps_executors, "datetime", Clock)

    async def main() -> None:
        registry = SimpleNamespace(scenarios={"nightly": scenario(cron="0 3 * * *")})
        jobs = JobStore(tmp_path / "jobs")
        runner = Runner()
        scheduler = Scheduler(registry, None, jobs, runner)  # type: ignore[arg-type]
        await scheduler.start()
        try:
            job = scheduler._aps.get_job("nightly:cron")
            assert job.next_run_time == dt.datetime(2026, 12, 1, 3, 0, tzinfo=dt.UTC)
            now[0] = dt.datetime(2026, 12, 1, 2, 59, tzinfo=dt.UTC)
            scheduler._aps.wakeup()
            await asyncio.sleep(0.2)
            assert runner.started == [] and jobs.list() == []
            now[0] = dt.datetime(2026, 12, 1, 3, 0, 1, tzinfo=dt.UTC)
            scheduler._aps.wakeup()
            await until(lambda: runner.started == ["nightly"])
            assert [(j.scenario, j.reason) for j in jobs.list()] == [("nightly", "cron")]
            assert scheduler._aps.get_job("nightly:cron").next_run_time == dt.datetime(2026, 12, 2, 3, 0,
                                                                                       tzinfo=dt.UTC)
            runner.finish["nightly"].set()
        finally:
            await scheduler.stop()

    asyncio.run(main())


def test_max_jobs_bounds_jobs_across_scenarios_first_come_first_served(tmp_path: Path) -> None:
    """REEF_MAX_JOBS=2 with four scenarios asking in order a, b, c, d: a and b run; c starts when one of them ends
    (whichever), then d; never more than two at once."""

    async def main() -> None:
        names = ["a", "b", "c", "d"]
        registry = SimpleNamespace(scenarios={n: scenario() for n in names})
        runner = Runner()
        scheduler = Scheduler(registry, None, JobStore(tmp_path / "jobs"), runner, max_jobs=2)  # type: ignore[arg-type]
        await scheduler.start()
        try:
            for n in names:
                await scheduler.submit(n, "manual")
            await until(lambda: len(runner.started) == 2)
            await asyncio.sleep(0.1)
            assert runner.started == ["a", "b"]
            runner.finish.setdefault("b", asyncio.Event()).set()
            await until(lambda: len(runner.started) == 3)
            assert runner.started == ["a", "b", "c"]  # c asked before d
            await asyncio.sleep(0.1)
            assert len(runner.started) == 3  # a and c run: two at most
            runner.finish.setdefault("a", asyncio.Event()).set()
            await until(lambda: runner.started == ["a", "b", "c", "d"])
            for n in "cd":
                runner.finish.setdefault(n, asyncio.Event()).set()
        finally:
            await scheduler.stop()

    asyncio.run(main())


def test_reefd_reads_max_jobs_from_its_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from reefd import __main__ as entry

    seen: dict[str, Any] = {}

    async def serve(settings: Any, *args: Any) -> int:
        seen["max_jobs"] = settings.max_jobs
        return 0

    monkeypatch.setattr(entry, "serve", serve)
    monkeypatch.setenv("REEF_MAX_JOBS", "3")
    from tests.conftest import make_scenarios

    assert entry.main(["--scenarios", str(make_scenarios(tmp_path / "s")), "--state", str(tmp_path / "st")]) == 0
    assert seen["max_jobs"] == 3


def test_what_a_stopped_reefd_left_runs_again_after_a_restart(tmp_path: Path) -> None:
    """Queued, still taking its batch, or training with no batch on disk yet: runs from the start. Training, with
    its batch on disk: trains again on that batch. Training on a cluster that outlived reefd: followed. Gating or
    publishing with its candidate saved: resumed in that stage. Gating or publishing without one: failed, with
    the reason."""
    store = JobStore(tmp_path / "jobs")
    for name, state, stage, files, detachable in [
        ("queued", "queued", "queued", (), False), ("batch", "running", "batch", (), False),
        ("train", "running", "train", ("spec.json",), False), ("cluster", "running", "train", ("spec.json",), True),
        ("unbatched", "running", "train", (), False), ("proposing", "running", "propose", (), False),
        ("gate", "running", "gate", ("spec.json", CANDIDATE), False), ("publish", "running", "publish", (CANDIDATE,),
                                                                        False),
        ("gone", "running", "gate", ("spec.json",), False), ("done", "published", "done", (), False),
    ]:
        job = store.new(name, "manual", "sao")
        job.state, job.stage, job.detachable = state, stage, detachable
        job.built_on = "r0-0000000"
        for file in files:
            store.workdir(job).mkdir(parents=True, exist_ok=True)
            (store.workdir(job) / file).write_text("{}")
        store.save(job)
    again = JobStore(tmp_path / "jobs")  # a restarted reefd reads the job files
    failed = {j.scenario: j.error for j in again.recover()}
    assert failed == {"gone": "reefd stopped during the job's gate stage and its candidate is gone"}
    assert [j.scenario for j in again.resumable()] == ["queued", "batch", "train", "cluster", "unbatched", "proposing",
                                                        "gate", "publish"]
    states = {j.scenario: (j.state, j.stage) for j in again.list()}
    assert states["batch"] == states["unbatched"] == states["proposing"] == ("queued", "queued")
    assert states["train"] == ("running", "train") and states["gate"] == ("running", "gate")
    assert states["publish"] == ("running", "publish")
    assert states["done"] == ("published", "done")


def test_users_lines_share_the_trainer_first_come_first_served_and_a_busy_user_starves_nobody(
        tmp_path: Path) -> None:
    """One job per line: alice asking again while her job runs joins it; bob and carol, who asked next, run
    before alice's next job; max_jobs bounds every line together."""

    class Lines(Runner):
        async def run(self, job: Job) -> None:
            key = line_key(job.scenario, job.user)
            self.started.append(key)
            job.state = "running"
            await self.finish.setdefault(key, asyncio.Event()).wait()
            self.finish.pop(key)
            job.state = "done"

    async def main() -> None:
        registry = SimpleNamespace(scenarios={"assist": scenario()})
        runner = Lines()
        scheduler = Scheduler(registry, None, JobStore(tmp_path / "jobs"), runner, max_jobs=1)  # type: ignore[arg-type]
        await scheduler.start()
        try:
            first = await scheduler.submit("assist", "count", "alice")
            assert await scheduler.submit("assist", "count", "alice") is first  # her line's job: joined
            for user in ("bob", "carol"):
                await scheduler.submit("assist", "count", user)
            await until(lambda: runner.started == ["assist/alice"])
            runner.finish["assist/alice"].set()
            await until(lambda: len(runner.started) == 2)
            await scheduler.submit("assist", "count", "alice")  # busy again: behind carol
            assert runner.started == ["assist/alice", "assist/bob"]
            runner.finish["assist/bob"].set()
            await until(lambda: len(runner.started) == 3)
            assert runner.started[-1] == "assist/carol"  # carol asked before alice's second time
            runner.finish["assist/carol"].set()
            await until(lambda: len(runner.started) == 4)
            assert runner.started[-1] == "assist/alice"
            runner.finish.setdefault("assist/alice", asyncio.Event()).set()
        finally:
            await scheduler.stop()

    asyncio.run(main())
