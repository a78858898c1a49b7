"""Grow jobs as records: a job's state, stage, progress and outcome, one JSON file each under STATE/jobs/, written
atomically at every transition; a job queued or running when reefd stopped runs again from where it can
(`recover`). Knows nothing about running a job (reefd/grow/runner.py) or when jobs run (reefd/grow/schedule.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd.observe.receipts import new_receipt
from reefd.ops.files import write_json

ACTIVE = ("queued", "running")
CANDIDATE = "candidate.json"  # in a job's folder: its candidate's kind, meta and folder, once made
STATES = (*ACTIVE, "published", "rejected", "failed", "skipped", "cancelled")


@dataclass
class Job:
    id: str
    scenario: str
    reason: str  # manual | count | interval | cron | promote | offered (grow/offers.py)
    recipe: str
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stage: str = "queued"  # batch | train (or propose) | gate | publish | done
    progress: dict[str, Any] = field(default_factory=dict)  # the trainer's last progress line
    built_on: str | None = None
    release: str | None = None  # the published release, or the rejected candidate
    verdict: dict[str, Any] | None = None
    error: str | None = None
    receipts: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # records not trained on: nothing in them, or past max_staleness
    staleness: dict[str, Any] | None = None  # a weight job's batch: releases behind its base (grow/staleness.py)
    detachable: bool = False  # its trainer runs on a cluster that outlives reefd: a restart follows it
    job_kind: str | None = None  # what its recipe's candidate is made by (weights, harness, search, bundle)
    user: str | None = None  # the user whose line it trains, on their records only (None: the shared line)
    users: list[str] = field(default_factory=list)  # a promotion's: the users whose records it trained on

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class JobStore:
    """Job files under `root` (one JSON file each, replaced atomically)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.jobs: dict[str, Job] = {}
        for path in sorted(root.glob("j-*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                data = json.loads(path.read_text())
                self.jobs[data["id"]] = Job(**data)

    def recover(self) -> list[Job]:
        """Jobs a stopped (or killed) reefd left queued or running. They run again (`resumable`), none lost:
        - one with nothing on disk yet to go on from (no batch, or no candidate while it proposed or searched)
          from the start (its records were never consumed);
        - one whose batch is on disk trains again on that same batch; one training on a cluster that outlived
          reefd follows that trainer;
        - one whose candidate is saved (CANDIDATE) resumes its gate, or its publish, on it.
        One stopped while it gated or published whose candidate is gone is marked failed, with the reason (its
        records stay eligible), and returned."""
        lost = [j for j in self.jobs.values() if j.state in ACTIVE and not self._resumable(j)]
        for job in lost:
            job.state, job.finished_at = "failed", time.time()
            job.error = f"reefd stopped during the job's {job.stage} stage and its candidate is gone"
            self.save(job)
        for job in self.jobs.values():
            if job.state == "running" and self.starts_over(job):
                job.state, job.stage, job.started_at, job.error = "queued", "queued", None, None
                self.save(job)
        return lost

    def resumable(self) -> list[Job]:
        """Jobs a stopped reefd left to run again, oldest first: the scheduler queues them before anything new."""
        return sorted((j for j in self.jobs.values() if j.state in ACTIVE and self._resumable(j)),
                      key=lambda j: j.created_at)

    def has_batch(self, job: Job) -> bool:
        """Its batch is on disk (the trainer's spec), so a restart trains it again on the same records."""
        return job.built_on is not None and (self.workdir(job) / "spec.json").is_file()

    def has_candidate(self, job: Job) -> bool:
        """Its candidate is saved, so a restart gates or publishes it again."""
        return job.built_on is not None and (self.workdir(job) / CANDIDATE).is_file()

    def starts_over(self, job: Job) -> bool:
        """A running job with nothing on disk to go on from: its candidate was not made yet, and no batch or
        cluster trainer will make it."""
        if job.stage in ("queued", "batch"):
            return True
        return job.stage not in ("gate", "publish", "done") and not job.detachable and not self.has_batch(job)

    def _resumable(self, job: Job) -> bool:
        if job.state == "queued" or self.starts_over(job):
            return True
        if job.stage in ("gate", "publish"):
            return job.state == "running" and self.has_candidate(job)
        return job.state == "running" and job.stage == "train"

    def new(self, scenario: str, reason: str, recipe: str, user: str | None = None) -> Job:
        """A queued job, listed at once (the caller saves it)."""
        job = Job(id=f"j-{new_receipt().lower()}", scenario=scenario, reason=reason, recipe=recipe, user=user)
        self.jobs[job.id] = job
        return job

    def save(self, job: Job) -> None:
        write_json(self.root / f"{job.id}.json", job.as_json(), indent=1)

    def workdir(self, job: Job) -> Path:
        return self.root / job.id

    def active(self, scenario: str, user: str | None = None) -> Job | None:
        """The queued or running job of the scenario's shared line, or of `user`'s (at most one each)."""
        return next((j for j in self.jobs.values() if j.scenario == scenario and j.user == user
                     and j.state in ACTIVE), None)

    def forget(self, scenario: str, user: str) -> int:
        """Remove every job of `user`'s line, file and folder (a user's deletion: a job lists their receipts).
        None may be active. Returns how many (blocking)."""
        gone = [j for j in self.jobs.values() if j.scenario == scenario and j.user == user]
        if any(j.state in ACTIVE for j in gone):
            raise RuntimeError(f"user {user!r} of {scenario!r} has a job queued or running: cancel it first")
        for job in gone:
            (self.root / f"{job.id}.json").unlink(missing_ok=True)
            shutil.rmtree(self.workdir(job), ignore_errors=True)
            del self.jobs[job.id]
        return len(gone)

    def all_active(self, scenario: str) -> list[Job]:
        """The scenario's queued or running jobs: its shared line's, and its users'."""
        return [j for j in self.jobs.values() if j.scenario == scenario and j.state in ACTIVE]

    def last(self, scenario: str, user: str) -> Job | None:
        """The newest job of `user`'s line."""
        return max((j for j in self.jobs.values() if j.scenario == scenario and j.user == user),
                   key=lambda j: j.created_at, default=None)

    def list(self, scenario: str | None = None) -> list[Job]:
        return sorted((j for j in self.jobs.values() if scenario is None or j.scenario == scenario),
                      key=lambda j: j.created_at, reverse=True)
