"""The bundle job kind: one batch made into an adapter (trained as the weights kind trains one) and a harness edit
(proposed as the harness kind proposes one), kept in one candidate folder (adapter/ and harness/), gated once against
what serves (each side answering with its own adapter and its own harness) and released as one `bundle` release, so
that the two are swapped and rolled back together. Knows nothing about recipes' losses or prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from reefd.commit import gates
from reefd.grow.job_kinds import JobContext, JobFailed, Made
from reefd.grow.job_kinds.harness_job import HarnessKind, Proposal
from reefd.grow.job_kinds.weight_job import WeightsKind
from reefd.grow.job_store import Job
from reefd.grow.recipes import Bundle
from reefd.harness import Harness, HarnessError
from reefd.ops.files import write_json
from reefd.serve.scenarios import Scenario

log = logging.getLogger("reefd.grow.runner")

PROPOSAL = "proposal"  # in a bundle job's folder: the proposed harness, rendered before the adapter trains
PROPOSAL_META = "proposal.json"  # beside it: what the release keeps of the proposal (a restart trains again)


class BundleKind:
    def __init__(self, runner: JobContext, weights: WeightsKind, harness: HarnessKind) -> None:
        self.runner, self.weights, self.harness = runner, weights, harness

    async def make(self, job: Job, scenario: Scenario, spec: Bundle, stack: contextlib.AsyncExitStack
                   ) -> Made | None:
        """Propose first (the serving release answers, before the trainer takes the CPU), then train. A proposal
        that only an operator may make (HarnessKind.refusal) is dropped, and the adapter goes on alone."""
        current = HarnessKind.serving(scenario)
        found = Proposal(None, "the harness recipe found nothing in the batch to learn from")
        if spec.harness is not None:
            await self.runner.save(job, "propose")
            found = await self.harness.propose(job, scenario, spec.harness, current)
            refused = HarnessKind.refusal(current, found.harness) if found.harness is not None else None
            if refused is not None:  # the adapter goes on alone; the release says why its harness is unchanged
                log.warning("%s %s: %s", job.scenario, job.id, refused)
                found = Proposal(None, refused)
        weights = dataclasses.replace(spec.weights, samples=spec.samples)  # as the runner marked them
        job.skipped = [*weights.skipped, *job.skipped]
        await self.runner.save(job, "train")
        spec_path = await self.weights.write_spec(job, scenario, weights)
        await asyncio.to_thread(_keep, spec_path.parent, found.harness or current, found)
        return await self.train(job, scenario, spec_path, stack)

    async def train(self, job: Job, scenario: Scenario, spec_path: Path, stack: contextlib.AsyncExitStack) -> Made:
        """Train the written spec and put its adapter beside the kept proposal (also after a restart)."""
        work = spec_path.parent
        try:
            kept = json.loads(await asyncio.to_thread((work / PROPOSAL_META).read_text))
        except (OSError, ValueError) as exc:
            raise JobFailed(f"the bundle's harness proposal is gone: {exc}") from None
        made = await self.weights.train(job, scenario, spec_path, stack)
        if made.kind != "adapter":
            raise JobFailed("a bundle holds a LoRA adapter, and the weights recipe trained full weights")
        folder = await asyncio.to_thread(_assemble, work, made.artifact)
        return self.resumed(scenario, Made("bundle", _meta(made.meta, kept), folder))

    def resumed(self, scenario: Scenario, made: Made) -> Made:
        try:
            proposed = Harness.from_dir(made.artifact / "harness")
        except HarnessError as exc:
            raise JobFailed(f"the bundle's harness is unreadable: {exc}") from None
        return dataclasses.replace(made, harnesses=(HarnessKind.serving(scenario), proposed))

    async def gate(self, job: Job, scenario: Scenario, made: Made, gate: gates.Gate) -> gates.Verdict:
        """The candidate adapter with the proposed harness against the serving adapter with the serving harness."""
        assert made.harnesses is not None
        current, proposed = (scenario.harness_text(h) for h in made.harnesses)
        return await self.weights.gate_adapter(job, scenario, made.artifact / "adapter", gate, (current, proposed))


def _keep(work: Path, harness: Harness, found: Proposal) -> None:
    """The proposal on disk beside the trainer's spec (blocking)."""
    harness.render(work / PROPOSAL)
    write_json(work / PROPOSAL_META, {"changed": found.harness is not None, "reason": found.reason,
                                      "meta": found.meta})


def _assemble(work: Path, adapter: Path) -> Path:
    """The candidate folder: the trained adapter and a copy of the proposal (kept for a restart) (blocking)."""
    folder = work / "bundle"
    shutil.rmtree(folder, True)
    folder.mkdir()
    adapter.rename(folder / "adapter")
    shutil.copytree(work / PROPOSAL, folder / "harness")
    return folder


def _meta(trained: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """What the release keeps: the adapter's training (metrics, params, the weights it was trained on, its proof)
    and the harness proposal (mutations, the proposer's answer), one summary of both."""
    proposal = kept.get("meta") or {}
    harness = proposal.get("summary") if kept.get("changed") else f"unchanged ({kept.get('reason')})"
    meta = {**trained, "summary": f"{trained.get('summary')}; harness: {harness}",
            "metrics": {**(trained.get("metrics") or {}), "mutations": len(proposal.get("mutations") or ())},
            "reports": sorted({*trained.get("reports", ()), *proposal.get("reports", ())}),
            "params": {**(trained.get("params") or {}), "proposer": {
                k: v for k, v in (proposal.get("params") or {}).items() if k not in ("recipe", "recipe_params")}}}
    for key in ("mutations", "proposal"):
        if key in proposal:
            meta[key] = proposal[key]
    if not kept.get("changed"):
        meta["harness_unchanged"] = kept.get("reason")
    return meta
