"""Candidates made outside a recipe, offered whole to a line's gate (the Tinker API's checkpoints): a job of reason
`offered` whose folder holds the adapter (copied when offered, so the job goes on after a restart) and what its
release will say of it; the runner takes it straight to the gate, then commits it as a recipe's candidate.
Torch-free."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

from reefd.commit.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from reefd.commit.chain import ReleaseChain
from reefd.grow.job_kinds import JobFailed, Made
from reefd.grow.job_store import Job, JobStore
from reefd.ops.files import write_json

OFFERED = "offered"  # the job's reason
_OFFER = "offer.json"  # in the job's folder: the release meta the offer brought


def write_offer(jobs: JobStore, job: Job, folder: Path, meta: dict[str, Any]) -> None:
    """The adapter in `folder` and `meta`, into the job's folder (replacing an earlier offer's; blocking)."""
    work = jobs.workdir(job)
    tmp, out = work / "offered.tmp", work / "offered"
    shutil.rmtree(tmp, True)
    tmp.mkdir(parents=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(folder / name, tmp / name)
    shutil.rmtree(out, True)
    tmp.rename(out)
    write_json(work / _OFFER, {"meta": meta})


async def offered(chain: ReleaseChain, jobs: JobStore, job: Job) -> Made:
    """The job's candidate, built on its line's head as it is now (JobFailed: no base release, or the offer's
    files are gone)."""
    head = await asyncio.to_thread(chain.line_head, job.scenario, job.user)
    if head is None:
        raise JobFailed("the scenario has no base release yet")
    work = jobs.workdir(job)
    try:
        meta = json.loads((work / _OFFER).read_text())["meta"]
    except (OSError, ValueError, KeyError) as exc:
        raise JobFailed(f"the offered candidate's files are gone: {exc}") from None
    job.built_on, job.job_kind = head.id, "weights"
    return Made("adapter", {**meta, "job": job.id}, work / "offered")
