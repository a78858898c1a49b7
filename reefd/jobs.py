"""One Grow job, start to end: batch → trainer subprocess → gate → publish (or reject) → hot swap.

A job's state is a JSON file under STATE/jobs/ written atomically at every transition, so a
restart finds it; a job that was queued or running when reefd stopped is marked failed with that
reason (`JobStore.recover`). Knows the recipe contract, the trainer's JSON-lines protocol, the
gates and the chain; the scheduling (which job runs when) is in reefd/schedule.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reefd import gates
from reefd.chat import ChatRequest, Completion, add_system_text
from reefd.config import ModelConfig
from reefd.engines import Engine, EngineError, EngineUnavailable, build_engine
from reefd.harness import Harness, HarnessError
from reefd.receipts import new_receipt
from reefd.recipes import HarnessJob, Recipe, RecipeError, Sample, WeightJob, build
from reefd.releases import HeadConflict, Release, ReleaseChain, ReleaseError
from reefd.trainers import TrainerBackend, TrainerTimeout

if TYPE_CHECKING:
    from reefd.reconcile import Binding
    from reefd.records import RecordStore
    from reefd.scenarios import Registry, Scenario

log = logging.getLogger("reefd.jobs")

ACTIVE = ("queued", "running")
STATES = (*ACTIVE, "published", "rejected", "failed", "skipped")


class JobFailed(Exception):
    """The job cannot go on; str() is the one-line reason recorded on it."""


@dataclass
class Job:
    id: str
    scenario: str
    reason: str  # manual | count | interval | cron
    recipe: str
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stage: str = "queued"  # batch | train | gate | publish | done
    progress: dict[str, Any] = field(default_factory=dict)  # the trainer's last progress line
    built_on: str | None = None
    release: str | None = None  # the published release, or the rejected candidate
    verdict: dict[str, Any] | None = None
    error: str | None = None
    receipts: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

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
        """Jobs a stopped reefd left queued or running: marked failed, with the reason."""
        lost = [j for j in self.jobs.values() if j.state in ACTIVE]
        for job in lost:
            job.state, job.finished_at = "failed", time.time()
            job.error = ("reefd stopped while the job was queued" if job.stage == "queued"
                         else f"reefd stopped during the job's {job.stage} stage")
            self.save(job)
        return lost

    def new(self, scenario: str, reason: str, recipe: str) -> Job:
        job = Job(id=f"j-{new_receipt().lower()}", scenario=scenario, reason=reason, recipe=recipe)
        self.jobs[job.id] = job
        self.save(job)
        return job

    def save(self, job: Job) -> None:
        tmp = self.root / f".{job.id}.tmp"
        with tmp.open("w") as f:
            json.dump(job.as_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.root / f"{job.id}.json")

    def workdir(self, job: Job) -> Path:
        return self.root / job.id

    def list(self, scenario: str | None = None) -> list[Job]:
        return sorted((j for j in self.jobs.values() if scenario is None or j.scenario == scenario),
                      key=lambda j: j.created_at, reverse=True)


class Runner:
    """Runs one job through every stage; never raises (the job records what went wrong)."""

    def __init__(self, registry: Registry, store: RecordStore, chain: ReleaseChain, jobs: JobStore,
                 scenarios_dir: Path, trainers: TrainerBackend) -> None:
        self.registry, self.store, self.chain, self.jobs = registry, store, chain, jobs
        self.scenarios_dir = scenarios_dir
        self.trainers = trainers
        # per-task gate scores already measured: (adapter tree id, gate fingerprint) -> means in task order
        self._scores: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    SCORES_KEPT = 64

    def _remember(self, artifact: str | None, digest: str | None, scores: list[float | None]) -> None:
        if artifact is None or digest is None or any(x is None for x in scores):
            return
        self._scores[(artifact, digest)] = [float(x) for x in scores if x is not None]
        self._scores.move_to_end((artifact, digest))
        while len(self._scores) > self.SCORES_KEPT:
            self._scores.popitem(last=False)

    async def _known_scores(self, binding: Binding, digest: str) -> list[float] | None:
        """The serving adapter's per-task scores under this gate fingerprint: measured by an earlier gate of this
        process, or kept in release.json by the gate that admitted it (for a rollback or promote, by the gate
        that admitted the release it copies)."""
        known = self._scores.get((_adapter_key(binding), digest))
        if known is not None or binding.artifact is None:
            return known
        return await asyncio.to_thread(self._admitted_scores, binding.release, digest)

    def _admitted_scores(self, release: str, digest: str) -> list[float] | None:
        try:
            rel = self.chain.get(release, include_rejected=True)
        except ReleaseError:
            return None
        for meta in (rel.meta, rel.meta.get("target_meta") or {}):
            gate = meta.get("gate") if isinstance(meta, dict) else None
            if isinstance(gate, dict) and gate.get("fingerprint") == digest and gate.get("per_task"):
                scores = [p.get("candidate") for p in gate["per_task"] if isinstance(p, dict)]
                numbers = [float(x) for x in scores if isinstance(x, int | float)]
                if len(numbers) == len(gate["per_task"]):
                    return numbers
        return None

    async def run(self, job: Job) -> None:
        job.state, job.started_at = "running", time.time()
        self.jobs.save(job)
        try:
            await self._run(job)
        except asyncio.CancelledError:
            job.state, job.error = "failed", "reefd stopped while the job was running"
            raise
        except (JobFailed, RecipeError, gates.GateError, ReleaseError, EngineError, EngineUnavailable,
                OSError) as exc:
            job.state, job.error = "failed", str(exc) or type(exc).__name__
            log.error("%s %s failed: %s", job.scenario, job.id, job.error)
        except Exception as exc:  # a bug must not take the scheduler down; the job says what happened
            log.exception("%s %s failed", job.scenario, job.id)
            job.state, job.error = "failed", f"internal error: {exc}"
        finally:
            job.finished_at = time.time()
            if job.state == "running":
                job.state = "failed"
            self.jobs.save(job)
            work = self.jobs.workdir(job)
            if job.state != "failed" or not os.environ.get("REEF_KEEP_FAILED_JOBS"):
                await asyncio.to_thread(shutil.rmtree, work, True)

    def _stage(self, job: Job, stage: str) -> None:
        job.stage = stage
        self.jobs.save(job)

    def _scenario(self, job: Job) -> Scenario:
        scenario = self.registry.scenarios.get(job.scenario)
        if scenario is None:
            raise JobFailed(f"scenario {job.scenario!r} is no longer served")
        return scenario

    async def _run(self, job: Job) -> None:
        scenario = self._scenario(job)
        recipe = build(scenario.cfg.recipe.name, scenario.cfg.recipe.params)
        if not recipe.trains:
            job.state, job.error = "skipped", f"recipe {job.recipe!r} does not train"
            return
        self._stage(job, "batch")
        samples = await asyncio.to_thread(self.batch, recipe, job.scenario)
        if not samples or (job.reason != "manual" and not recipe.ready(samples)):
            job.state = "skipped"
            job.error = f"no batch ready: {len(samples)} eligible scored record(s) waiting"
            return
        binding = scenario.binding
        spec = recipe.candidate(samples, binding.harness if binding is not None else None)
        job.receipts = [s.receipt for s in spec.samples]
        head = self.chain.head(job.scenario)
        if head is None:
            raise JobFailed("the scenario has no base release yet")
        job.built_on = head.id
        self.jobs.save(job)
        if isinstance(spec, HarnessJob):
            await self._harness_job(job, scenario, recipe, spec, head)
            return

        self._stage(job, "train")
        work = self.jobs.workdir(job)
        out = await self.train(job, scenario, spec, head, work)

        self._stage(job, "gate")
        scenario = self._scenario(job)  # a reload while it trained may have replaced the scenario's objects
        verdict = await self.gate(job, scenario, out)
        job.verdict = verdict.as_meta()

        self._stage(job, "publish")
        meta = {"source": job.recipe, "job": job.id, "summary": f"{job.recipe} on {len(job.receipts)} records",
                "metrics": job.metrics, "gate": job.verdict, "receipts": job.receipts,
                "reports": sorted({r for s in spec.samples for r in s.reports}), "built_on": head.id}
        await self._finish(job, scenario, head, out, "adapter", meta, verdict)

    async def _finish(self, job: Job, scenario: Scenario, head: Release, out: Path, kind: str,
                      meta: dict[str, Any], verdict: gates.Verdict) -> None:
        """Publish (or keep as rejected) the candidate, consume its records, swap, and say how it ended."""
        if verdict.passed:
            rel = await self.publish(job, scenario, head, out, meta, kind)
        else:
            rel = await asyncio.to_thread(self.chain.reject, job.scenario, built_on=head.id, kind=kind,
                                          artifact_dir=out, meta=meta)
            log.info("%s %s: candidate %s rejected: %s", job.scenario, job.id, rel.id, verdict.reason)
        job.release = rel.id
        await self.store.mark_consumed(job.scenario, job.receipts, job.id)
        if rel.status == "released":  # swap before the job reports success: its next answer comes from it
            binding = await self.registry.reconciler.reconcile(scenario)
            if binding is None or binding.release != rel.id:
                live = self.registry.scenarios.get(job.scenario)
                job.error = f"published, but not serving yet: {live.error if live else 'scenario removed'}"
            elif kind == "adapter":  # the next gate's current side: scores measured on this adapter's tree
                self._remember(binding.artifact, verdict.fingerprint, [p["candidate"] for p in verdict.per_task])
        job.stage = "done"
        job.state = "published" if rel.status == "released" else "rejected"

    def batch(self, recipe: Recipe, scenario: str) -> list[Sample]:
        """The recipe's eligible samples among the records no candidate consumed yet, oldest first."""
        samples = []
        for record in self.store.unconsumed(scenario):
            sample = recipe.sample(record, record.get("reports", []))
            if sample is not None:
                samples.append(sample)
        return samples

    # ------------------------------------------------------------ train

    async def train(self, job: Job, scenario: Scenario, spec: WeightJob, head: Release, work: Path) -> Path:
        """Train on the batch in a `python -m reefd.train` process; returns the candidate adapter folder."""
        model_dir = scenario.engine.model_folder()
        if model_dir is None:
            raise JobFailed("the scenario's model is not prepared yet")
        await asyncio.to_thread(shutil.rmtree, work, True)
        work.mkdir(parents=True)
        init = None
        if "adapter" in await asyncio.to_thread(self.chain.artifacts, head.id):  # continue from what serves
            init = await asyncio.to_thread(self.chain.materialize, head.id, work / "init", "adapter")
        out = work / "candidate"
        doc = {"job": job.id, "algorithm": spec.algorithm, "base_model": str(model_dir),
               "init_adapter": str(init) if init else None, "output_dir": str(out),
               "samples": [{k: v for k, v in dataclasses.asdict(s).items() if k != "context"} for s in spec.samples],
               "lora": spec.lora, "optim": spec.optim,
               "sao": {k: v for k, v in spec.settings.items() if k != "seed"}, "seed": spec.settings.get("seed", 0)}
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(doc))
        error: str | None = None

        def on_event(event: dict[str, Any]) -> None:
            nonlocal error
            if event.get("event") == "progress":
                job.progress = {k: v for k, v in event.items() if k != "event"}
            elif event.get("event") == "done":
                job.metrics = dict(event.get("metrics") or {})
            elif event.get("event") == "error":
                error = str(event.get("reason"))

        try:
            code = await self.trainers.run(spec_path, on_event, scenario.cfg.recipe.job_timeout_s)
        except TrainerTimeout as exc:
            raise JobFailed(str(exc)) from None
        if code != 0:
            died = "the trainer process died" if code in (137, -9) else "no message"
            raise JobFailed(f"the trainer failed (exit {code}): {error or died}")
        if not (out / "adapter_model.safetensors").is_file():
            raise JobFailed("the trainer exited without writing an adapter")
        return out

    # ------------------------------------------------------------ gate

    async def gate(self, job: Job, scenario: Scenario, out: Path | None,
                   harnesses: tuple[Harness, Harness] | None = None) -> gates.Verdict:
        """Judge the candidate against the serving release, both answered by the scenario's engine: an adapter
        candidate (`out`) is loaded beside the serving one; a harness candidate (`harnesses`: current, proposed)
        differs in the system prompt only."""
        cfg = scenario.cfg.gate
        binding = scenario.binding
        serving = binding.adapter if binding else None
        if cfg.kind == "always":
            return await gates.evaluate(cfg, self.scenarios_dir, _no_generate, current=None, candidate=None)
        engine = scenario.engine
        name = f"candidate-{job.id}"
        inline = scenario.cfg.harness.inline_skills
        blocks = {"current": harnesses[0].prompt_block(inline_skills=inline),
                  "candidate": harnesses[1].prompt_block(inline_skills=inline)} if harnesses else {}

        async def generate(messages: list[dict[str, Any]], side: str | None, gate: Any, seed: int) -> str:
            req = ChatRequest(messages=messages, max_tokens=gate.max_tokens, temperature=gate.temperature,
                              seed=seed)
            adapter = side
            if harnesses is not None:  # both sides use the serving adapter; the harness is what differs
                add_system_text(req, blocks[str(side)])
                adapter = serving
            return await _answer(engine, req, adapter, scenario.cfg.serve.request_timeout_s)

        width = max(2, scenario.cfg.model.max_batch)  # both sides' requests in the engine's batches
        if harnesses is not None:
            with self.registry.using(engine, serving):
                return await gates.evaluate(cfg, self.scenarios_dir, generate, current="current",
                                            candidate="candidate", concurrency=width)
        assert out is not None
        model = {k: v for k, v in dataclasses.asdict(scenario.cfg.model).items() if k != "max_batch"}
        context = {"prompts": "raw", "model": model}
        known = None
        # reused scores stand for re-generated ones only where sampling is reproducible: greedy, or the worker,
        # which samples each request with its own seeded generator
        if cfg.reuse_current and binding is not None and (cfg.temperature == 0 or model["engine"] == "worker"):
            known = functools.partial(self._known_scores, binding)
        with self.registry.using(engine, serving):  # held from before the load: the serving adapter stays
            await engine.load_adapter(name, out)
            try:
                verdict = await gates.evaluate(cfg, self.scenarios_dir, generate, current=serving, candidate=name,
                                               concurrency=width, context=context, known_current=known)
            finally:
                with contextlib.suppress(EngineError, EngineUnavailable):
                    await engine.unload_adapter(name)
        if binding is not None and not verdict.current_reused and verdict.current_mean is not None:
            self._remember(_adapter_key(binding), verdict.fingerprint, [p["current"] for p in verdict.per_task])
        return verdict

    # ------------------------------------------------------------ publish

    async def publish(self, job: Job, scenario: Scenario, head: Release, out: Path, meta: dict[str, Any],
                      kind: str = "adapter") -> Release:
        """Append on the head the candidate was built on; if it moved, follow the scenario's on_conflict policy."""
        if scenario.cfg.release.pin is not None:
            meta = {**meta, "refused": f"the scenario is pinned to {scenario.cfg.release.pin}"}
            return await asyncio.to_thread(self.chain.reject, job.scenario, built_on=head.id, kind=kind,
                                           artifact_dir=out, meta=meta)
        try:
            return await asyncio.to_thread(self.chain.publish, job.scenario, expected_head=head.id, kind=kind,
                                           artifact_dir=out, meta=meta)
        except HeadConflict as exc:
            if scenario.cfg.release.on_conflict == "rebase" and exc.actual is not None:
                log.info("%s %s: head moved to %s; rebasing the candidate", job.scenario, job.id, exc.actual)
                rebased = {**meta, "rebased_from": head.id, "built_on": exc.actual}
                return await asyncio.to_thread(self.chain.publish, job.scenario, expected_head=exc.actual,
                                               kind=kind, artifact_dir=out, meta=rebased)
            meta = {**meta, "refused": f"the head moved to {exc.actual} while the candidate was built"}
            return await asyncio.to_thread(self.chain.reject, job.scenario, built_on=head.id, kind=kind,
                                           artifact_dir=out, meta=meta)

    # ------------------------------------------------------------ harness candidates

    async def _harness_job(self, job: Job, scenario: Scenario, recipe: Recipe, spec: HarnessJob,
                           head: Release) -> None:
        """Propose (an LLM call), validate, gate by paired comparison, publish a harness release."""
        binding = scenario.binding
        current = binding.harness if binding is not None else None
        if current is None:
            raise JobFailed("the scenario has no harness to evolve (set harness.dir in its file)")
        self._stage(job, "propose")
        answer = await self._propose(scenario, spec)
        try:
            mutations = recipe.edit(answer, current)  # type: ignore[attr-defined]
            proposed = current.apply(mutations)
        except (RecipeError, HarnessError) as exc:
            job.state, job.error = "skipped", f"proposal refused: {exc}"
            job.metrics = {"proposer_answer": answer[:4000]}
            return
        if not mutations or proposed.files() == current.files():
            job.state, job.error = "skipped", "the proposer proposed no change"
            job.metrics = {"proposer_answer": answer[:4000]}
            return
        job.metrics = {"mutations": len(mutations), "proposer_answer": answer[:4000]}
        self._stage(job, "gate")
        verdict = await self.gate(job, scenario, None, harnesses=(current, proposed))
        job.verdict = verdict.as_meta()
        self._stage(job, "publish")
        meta = {"source": job.recipe, "job": job.id, "summary": proposed.summary(current),
                "metrics": {"mutations": len(mutations)}, "gate": job.verdict, "receipts": job.receipts,
                "reports": sorted({r for s in spec.samples for r in s.reports}), "built_on": head.id,
                "mutations": mutations}
        work = self.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        await asyncio.to_thread(proposed.render, work / "harness")
        await self._finish(job, scenario, head, work / "harness", "harness", meta, verdict)

    async def _propose(self, scenario: Scenario, spec: HarnessJob) -> str:
        """The proposer's answer: the scenario's own engine, or the model named in the recipe's config."""
        engine, adapter, temporary = scenario.engine, scenario.binding.adapter if scenario.binding else None, False
        if spec.proposer is not None:
            try:
                cfg = ModelConfig(**spec.proposer)
            except TypeError as exc:
                raise JobFailed(f"recipe.params.proposer: {exc}") from None
            key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
            engine, adapter = self.registry.engines.get(key) or build_engine(
                cfg, self.registry.state_dir, self.registry.session), None
            temporary = key not in self.registry.engines
            if temporary:
                await engine.start()
        try:
            deadline = time.monotonic() + (spec.proposer or {}).get("startup_timeout_s", 600.0)
            while not engine.ready:
                if engine.describe()["state"] == "failed" or time.monotonic() > deadline:
                    raise JobFailed(f"the proposer engine is {engine.describe()['state']}")
                await asyncio.sleep(0.25)
            req = ChatRequest(messages=spec.messages, max_tokens=spec.max_tokens, temperature=spec.temperature)
            return await _answer(engine, req, adapter, scenario.cfg.serve.request_timeout_s)
        finally:
            if temporary:
                await engine.stop()


def _adapter_key(binding: Binding) -> str:
    """What a gate's scores of the serving side belong to: its adapter's tree, or the base model."""
    return binding.artifact if binding.adapter is not None and binding.artifact is not None else "base"


async def _answer(engine: Engine, req: ChatRequest, adapter: str | None, timeout_s: float) -> str:
    """The text of one non-streamed answer from `engine`."""
    async for event in engine.generate(req, stream=False, adapter=adapter, timeout_s=timeout_s):
        if isinstance(event, Completion):
            return event.text or ""
    raise JobFailed("the engine ended without an answer")


async def _no_generate(messages: list[dict[str, Any]], adapter: str | None, gate: Any, seed: int) -> str:
    raise JobFailed("the always gate generates nothing")
