"""Promotion: what many users learned reaching the shared release (opt-in per scenario: `users.share`).

A promotion is a job of the scenario's shared line (`reefctl train NAME --promote`) whose batch is the records
that consenting users' own releases learned from: for each user who said yes (`reefctl users share`), the
records their line's published releases were trained on. It is built on the shared head and judged by the
scenario's gate against the shared release, like any shared job; its release names those users in its meta
(`users`), which `reefctl explain` shows. It consumes nothing: those records already taught their users' lines.
Knows nothing of HTTP or of how a job runs (reefd/grow/runner.py).
"""

from __future__ import annotations

import dataclasses
import itertools

from reefd.commit.chain import ReleaseChain
from reefd.grow.job_store import Job
from reefd.grow.recipes import Recipe, Sample
from reefd.observe.records import RecordStore
from reefd.observe.retention import receipts_of
from reefd.serve.tenancy import UsersConfig

PROMOTE = "promote"  # a job's reason: a promotion of the shared line


def promoted(store: RecordStore, chain: ReleaseChain, recipe: Recipe, scenario: str,
             users: list[str]) -> tuple[list[Sample], dict[str, str]]:
    """The samples of the records that `users`' own published releases learned from, taking each user's in turn
    (alice's first, bob's first, alice's second, ...: a batch cut from the front holds every user's), and whose
    each is (receipt -> user) (blocking)."""
    per_user: list[list[Sample]] = []
    whose: dict[str, str] = {}
    for user in sorted(users):
        receipts: set[str] = set()
        for rel in chain.history(scenario, user=user):
            if rel.user == user:  # their own releases, not the shared ones their line forked from
                receipts_of(rel.meta, receipts)
        found = []
        for receipt in sorted(receipts):  # receipts sort in the order they were made
            record = store.get_record(receipt)
            sample = None if record is None else recipe.sample(record, record.get("reports", []))
            if record is not None and sample is not None:
                found.append(dataclasses.replace(sample, release=record.get("release")))
                whose[receipt] = user
        per_user.append(found)
    turns = [s for row in itertools.zip_longest(*per_user) for s in row if s is not None]
    return turns, whose


def promotion_batch(job: Job, users: UsersConfig | None, store: RecordStore, chain: ReleaseChain, recipe: Recipe,
                    sharing: list[str]) -> tuple[list[Sample], dict[str, str]] | None:
    """A promotion's samples and whose each is, its users in job.users; None, the job skipped saying why, when
    fewer than users.share_min_users of the users who share (`sharing`) have releases that learned from any
    record (blocking)."""
    assert users is not None  # the train route refuses a promotion elsewhere
    samples, whose = promoted(store, chain, recipe, job.scenario, sharing)
    job.users = sorted(set(whose.values()))
    if len(job.users) >= users.share_min_users:
        return samples, whose
    job.state = "skipped"
    job.error = (f"nothing to promote: {len(job.users)} of the {len(sharing)} users who share have releases of their "
                 f"own that learned from records, fewer than users.share_min_users ({users.share_min_users})")
    return None
