"""One Grow job, start to end: batch → candidate (a trainer job, or a proposer's harness edit) → gate → commit.

The runner owns a job's stages; the recipe says what a candidate is, the trainer backend trains it, the gate
judges it against the serving release on the scenario's own engine, `write` (wired in reefd/loop.py: the
chain's commit policy) publishes or rejects it, and `swap` (the reconciler) serves it. Never raises out of
`run`: the job records what went wrong. Knows the recipe contract and the trainer spec; nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reefd import plugins
from reefd.commit import gates
from reefd.commit.chain import Candidate, Release, ReleaseChain, ReleaseError
from reefd.commit.gates.memory import ScoreMemory
from reefd.commit.gates.tasks import load_tasks
from reefd.commit.weights import InvalidWeights, check_weights
from reefd.engines import Engine, EngineError, EngineUnavailable, ModelConfig
from reefd.grow import staleness
from reefd.grow.backends.local import Backends, TrainerTimeout
from reefd.grow.job_store import Job, JobStore
from reefd.grow.recipes import (
    Ask,
    Found,
    HarnessJob,
    HarnessSearch,
    Recipe,
    RecipeError,
    Sample,
    Search,
    SearchContext,
    WeightJob,
    build,
)
from reefd.harness import Harness, HarnessError
from reefd.observe.records import RecordStore
from reefd.ops.files import write_json
from reefd.serve.chat import ChatRequest, Completion, add_system_text
from reefd.serve.scenarios import Binding, Registry, Scenario

log = logging.getLogger("reefd.grow.runner")

SPEC_PARAMS = ("objective", "settings", "seed", "lora", "optim", "target")  # the trainer spec's, kept in `params`
PROPOSAL_CHARS = 64 << 10  # a proposer's answer beyond this is cut in the release

Write = Callable[[Scenario, Candidate], Awaitable[Release]]
"""(scenario, candidate) -> the release written by the chain's commit policy: released, or kept as rejected."""

Swap = Callable[[Scenario], Awaitable[object]]
"""Serve the scenario's head now (the reconciler's hot swap)."""


class JobFailed(Exception):
    """The job cannot go on; str() is the one-line reason recorded on it."""


def eligible(store: RecordStore, recipe: Recipe, scenario: str) -> list[Sample]:
    """The recipe's samples among the scenario's records no candidate consumed yet, oldest first, each with the
    release that served its record (blocking)."""
    samples = []
    for record in store.unconsumed(scenario):
        sample = recipe.sample(record, record.get("reports", []))
        if sample is not None:
            samples.append(dataclasses.replace(sample, release=record.get("release")))
    return samples


def serving_key(binding: Binding) -> str:
    """What a gate's scores of the serving side belong to: its adapter's tree, or the base model, on its weights."""
    adapter = binding.artifact if binding.adapter is not None and binding.artifact is not None else "base"
    return adapter if binding.weights is None else f"{adapter}@{binding.weights}"


class Runner:
    def __init__(self, registry: Registry, store: RecordStore, chain: ReleaseChain, jobs: JobStore,
                 scenarios_dir: Path, backends: Backends, write: Write, swap: Swap) -> None:
        self.registry, self.store, self.chain, self.jobs = registry, store, chain, jobs
        self.scenarios_dir = scenarios_dir
        self.backends = backends
        self.write, self.swap = write, swap
        self.scores = ScoreMemory(self._meta_of)
        self.cancelling: set[str] = set()  # jobs an operator cancelled: their task's CancelledError is that

    def _meta_of(self, release: str) -> dict[str, Any] | None:
        try:
            return self.chain.get(release, include_rejected=True).meta
        except ReleaseError:
            return None

    def prewarm(self) -> None:
        """Get the trainer backends of the scenarios that train weights ready ahead of their first job."""
        names = []
        for scenario in self.registry.scenarios.values():
            if scenario.recipe is not None and scenario.recipe.produces == "weights":
                names.append(scenario.cfg.recipe.backend)
        self.backends.prewarm(names)

    async def close(self) -> None:
        await self.backends.close()

    async def _save(self, job: Job, stage: str | None = None) -> None:
        if stage is not None and job.id in self.cancelling:
            # a cancel that a stage swallowed (an engine being stopped absorbs its CancelledError): honoured at
            # the next stage, and always before anything is written to the chain
            raise asyncio.CancelledError
        job.stage = stage or job.stage
        await asyncio.to_thread(self.jobs.save, job)

    async def run(self, job: Job) -> None:
        resuming = job.state == "running" and (job.detachable or self.jobs.has_batch(job))
        again = False  # reefd stopped while the job trained here: the next reefd trains it again
        try:
            job.state, job.started_at = "running", job.started_at or time.time()
            await self._save(job)
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
                await asyncio.shield(self._save(job))
                raise
            elif job.stage == "train" and self.jobs.has_batch(job):  # the next reefd trains it again (`_resume`)
                again = True
                job.error = "reefd stopped while the job trained; a restart trains it again on the same batch"
                await asyncio.shield(self.stop_trainer(job))
                await asyncio.shield(self._save(job))
                raise
            else:
                job.state, job.error = "failed", "reefd stopped while the job was running"
                await asyncio.shield(self.stop_trainer(job))  # a cluster job that would not outlive reefd
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
        await asyncio.shield(self._save(job))
        log.info("%s %s: %s", job.scenario, job.id, job.error)
        # on a cluster (whether or not its job outlives reefd); a local trainer stopped with the task
        problem = await asyncio.shield(self.stop_trainer(job))
        if problem:
            job.error = f"{job.error}; {problem}"
            log.warning("%s %s: %s", job.scenario, job.id, problem)

    async def stop_trainer(self, job: Job) -> str | None:
        """Stop the job's trainer where it runs, when its backend runs jobs that outlive reefd (a cluster); what
        went wrong, or None."""
        scenario = self.registry.scenarios.get(job.scenario)
        if scenario is None:
            return "its scenario is no longer served, so its trainer was not stopped on the cluster"
        try:
            backend = self.backends.of(scenario.cfg.recipe)
        except plugins.PluginError as exc:
            return f"its trainer was not stopped on the cluster: {exc}"
        stop = getattr(backend, "stop", None)
        spec = self.jobs.workdir(job) / "spec.json"
        if stop is None or not spec.is_file():  # not on a cluster, or it never got there
            return None
        return await stop(spec)

    async def _close(self, job: Job) -> None:
        job.finished_at = time.time()
        if job.state == "running":
            job.state = "failed"
        await asyncio.shield(self._save(job))
        if job.state != "failed" or not os.environ.get("REEF_KEEP_FAILED_JOBS"):
            await asyncio.to_thread(shutil.rmtree, self.jobs.workdir(job), True)

    def _scenario(self, job: Job) -> Scenario:
        """The scenario as served now (a reload may have replaced its objects since the job started)."""
        scenario = self.registry.scenarios.get(job.scenario)
        if scenario is None:
            raise JobFailed(f"scenario {job.scenario!r} is no longer served")
        return scenario

    async def _run(self, job: Job) -> None:
        scenario = self._scenario(job)
        recipe = scenario.recipe or build(scenario.cfg.recipe.name, scenario.cfg.recipe.params)  # build: its error
        if recipe.produces == "nothing":
            job.state, job.error = "skipped", f"recipe {job.recipe!r} does not train"
            return
        await self._save(job, "batch")
        head = await asyncio.to_thread(self.chain.head, job.scenario)  # what the job is built on
        async with self.store.selecting(job.scenario):  # retention deletes none of them until job.receipts is set
            samples = await asyncio.to_thread(eligible, self.store, recipe, job.scenario)
            aged = None
            if recipe.produces == "weights" and head is not None:
                samples, aged = await self._aged(job, recipe, head, samples)
            needs_records = getattr(recipe, "needs_records", True)
            if (not samples and needs_records) or (job.reason != "manual" and not recipe.ready(samples)):
                job.state = "skipped"
                job.error = f"no batch ready: {len(samples)} eligible scored record(s) waiting"
                if aged is not None and aged.dropped:
                    job.error += f"; {len(aged.dropped)} past max_staleness dropped"
                return
            binding = scenario.binding
            spec = recipe.candidate(samples, binding.harness if binding is not None else None)
            if isinstance(spec, WeightJob) and aged is not None:
                spec.samples = aged.mark(spec.samples)
                job.staleness = aged.summary(spec.samples)
            job.receipts = [s.receipt for s in spec.samples]
        if head is None:
            raise JobFailed("the scenario has no base release yet")
        job.built_on = head.id
        await self._save(job)
        if isinstance(spec, HarnessJob):
            await self._harness_job(job, scenario, spec, head)
            return
        if isinstance(spec, HarnessSearch):
            await self._search_job(job, scenario, spec, head)
            return
        job.skipped = [*spec.skipped, *(aged.dropped if aged is not None else ())]
        await self._save(job, "train")
        spec_path = await self._write_spec(job, scenario, spec, head)
        await self._weights_job(job, scenario, spec_path)

    async def _aged(self, job: Job, recipe: Recipe, head: Release, samples: list[Sample]
                    ) -> tuple[list[Sample], staleness.Aged]:
        """The samples a weight job's batch may be chosen from, and each one's staleness behind `head`. Those past
        the recipe's max_staleness with `stale: drop` are consumed now: they only grow staler (the chain never
        rewinds)."""
        history = await asyncio.to_thread(self.chain.history, job.scenario)
        policy = getattr(recipe, "staleness", None) or staleness.Policy()
        kept, aged = staleness.age(samples, staleness.behind(history, head), policy)
        if aged.dropped:
            job.staleness = aged.summary([])
            await asyncio.shield(self.store.mark_consumed(job.scenario, aged.dropped, job.id))
            log.info("%s %s: %d sample(s) past max_staleness %s dropped", job.scenario, job.id, len(aged.dropped),
                     policy.max_staleness)
        return kept, aged

    async def _resume(self, job: Job) -> None:
        """A job reefd stopped while it trained. On a cluster that outlived reefd: follow the same trainer job (the
        backend finds it by the job's id; nothing is trained twice). Trained here: train again from the start
        on the same batch, its spec. Then gate and publish as usual."""
        scenario = self._scenario(job)
        spec_path = self.jobs.workdir(job) / "spec.json"
        if job.built_on is None or not spec_path.is_file():
            raise JobFailed("reefd stopped during the job and its files are gone")
        job.error = None
        if job.detachable:
            log.info("%s %s: following its trainer job again after a restart", job.scenario, job.id)
        else:
            log.info("%s %s: training again on the same batch after a restart", job.scenario, job.id)
            job.progress, job.metrics = {}, {}
            await asyncio.to_thread(shutil.rmtree, spec_path.parent / "candidate", True)  # what the last run left
        await self._weights_job(job, scenario, spec_path)

    async def _weights_job(self, job: Job, scenario: Scenario, spec_path: Path) -> None:
        """Train (the spec is written), gate, publish."""
        assert job.built_on is not None
        doc = json.loads(await asyncio.to_thread(spec_path.read_text))
        backend = self.backends.of(scenario.cfg.recipe)
        # a full HF model folder: asked for by the recipe, or what the backend always trains (slime)
        full = doc.get("target") == "full" or getattr(backend, "full_weights", False)
        weights = await asyncio.to_thread(self.chain.weights, job.built_on)  # what the candidate is trained on
        async with contextlib.AsyncExitStack() as stack:
            pushed = None  # the engine the trainer pushes its weights to, where the gate then judges them
            if getattr(backend, "pushes", False):
                pushed = await self._push_engine(stack, job, scenario, spec_path, doc)
            out = await self._train(job, scenario, spec_path, full)
            await self._save(job, "gate")
            scenario = self._scenario(job)
            if pushed is not None:
                await self._check_pushed(pushed, backend.pushed_version(doc), out)  # type: ignore[attr-defined]
            verdict = await (self._gate_weights(job, scenario, out, pushed) if full
                             else self._gate(job, scenario, out))
        job.verdict = verdict.as_meta()
        await self._save(job, "publish")
        meta = {"source": job.recipe, "job": job.id, "summary": f"{job.recipe} on {len(job.receipts)} records",
                "metrics": job.metrics, "receipts": job.receipts,
                "reports": sorted({r for s in doc["samples"] for r in s.get("reports") or ()}),
                "params": {**_recipe_params(scenario), "backend": scenario.cfg.recipe.backend,
                           **{k: doc.get(k) for k in SPEC_PARAMS}}}
        if job.skipped:
            meta["skipped"] = list(job.skipped)
        # an adapter serves only on the weights it was trained on; full weights say what they started from
        meta["trained_on" if full else "weights"] = weights
        await self._finish(job, scenario, Candidate("weights" if full else "adapter", meta, artifact=out,
                                                    built_on=job.built_on, verdict=job.verdict), verdict,
                           job.skipped)

    async def _finish(self, job: Job, scenario: Scenario, cand: Candidate, verdict: gates.Verdict,
                      skipped: list[str] | None = None) -> None:
        """Write the candidate to the chain (released, or kept as rejected), consume its records (and those the
        recipe `skipped`), and serve it: the job reports success only once its next answer comes from the new
        release."""
        rel = await self.write(scenario, cand)
        job.release = rel.id
        await asyncio.shield(self.store.mark_consumed(job.scenario, [*job.receipts, *(skipped or [])], job.id))
        if rel.status == "rejected":
            log.info("%s %s: candidate %s rejected: %s", job.scenario, job.id, rel.id,
                     rel.meta.get("refused") or verdict.reason)
        else:
            await self.swap(scenario)
            live = self.registry.scenarios.get(job.scenario)
            serving = {b.release: b for b in (live.binding if live is not None else None,
                                              live.trial.binding if live is not None and live.trial else None)
                       if b is not None}
            binding = serving.get(rel.id)  # serving everyone, or on trial as a canary or shadow
            if binding is None:
                job.error = f"published, but not serving yet: {live.error if live else 'scenario removed'}"
            elif cand.kind in ("adapter", "weights"):  # the next gate's current side: scores measured on this
                self.scores.remember(serving_key(binding), verdict.fingerprint,
                                     [p["candidate"] for p in verdict.per_task])
        job.stage = "done"
        job.state = "published" if rel.status == "released" else "rejected"

    # ------------------------------------------------------------ train

    async def _write_spec(self, job: Job, scenario: Scenario, spec: WeightJob, head: Release) -> Path:
        """The job's folder with its trainer spec (and the weights it trains on, when a weights release serves)."""
        model_dir = scenario.engine.model_folder()
        if model_dir is None:
            raise JobFailed("the scenario's model is not prepared yet")
        work = self.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        work.mkdir(parents=True)
        artifacts = await asyncio.to_thread(self.chain.artifacts, head.id)
        if "weights" in artifacts:  # train on the weights served
            model_dir = await asyncio.to_thread(self.chain.materialize, head.id, work / "base", "weights")
        init = None
        if "adapter" in artifacts:  # continue from what serves
            init = await asyncio.to_thread(self.chain.materialize, head.id, work / "init", "adapter")
        out = work / "candidate"
        doc = {"job": job.id, "objective": spec.objective, "settings": spec.settings, "seed": spec.seed,
               "base_model": str(model_dir), "init_adapter": str(init) if init else None, "output_dir": str(out),
               "samples": [{k: v for k, v in dataclasses.asdict(s).items() if k != "context"} for s in spec.samples],
               "lora": spec.lora, "optim": spec.optim, "target": spec.target}
        spec_path = work / "spec.json"
        await asyncio.to_thread(spec_path.write_text, json.dumps(doc))
        return spec_path

    async def _train(self, job: Job, scenario: Scenario, spec_path: Path, full: bool) -> Path:
        """Run the spec on the scenario's trainer backend; returns the candidate folder (an adapter, or with
        `target: full` a full HF model folder)."""
        work, out = spec_path.parent, spec_path.parent / "candidate"
        error: str | None = None

        def on_event(event: dict[str, Any]) -> None:
            nonlocal error
            if event.get("event") == "progress":
                job.progress = {k: v for k, v in event.items() if k != "event"}
            elif event.get("event") == "done":
                job.metrics = dict(event.get("metrics") or {})
            elif event.get("event") == "error":
                error = str(event.get("reason"))

        backend = self.backends.of(scenario.cfg.recipe)
        job.detachable = bool(getattr(backend, "detachable", False))
        if job.detachable:  # on disk before the job starts, so even a killed reefd's successor follows it
            await self._save(job)
        try:
            code = await backend.run(spec_path, on_event, scenario.cfg.recipe.job_timeout_s)
        except TrainerTimeout as exc:
            if not await asyncio.to_thread(_saved, out, job):
                raise JobFailed(str(exc)) from None
            code = 0  # stopped at the timeout, it saved the steps it finished: the gate judges those
            log.warning("%s %s: %s; gating the %s step(s) it saved", job.scenario, job.id, exc,
                        job.metrics.get("steps"))
        if code == 143 and await asyncio.to_thread(_saved, out, job):
            code = 0  # stopped on its cluster (not by reefd), it saved the steps it finished
        if code != 0:
            died = "the trainer process died" if code in (137, -9) else "no message"
            raise JobFailed(f"the trainer failed (exit {code}): {error or died}")
        job.detachable = False
        if full:
            if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
                raise JobFailed("the trainer exited without writing full weights")
            try:
                await asyncio.to_thread(check_weights, out, scenario.engine.model_folder() or work / "base")
            except InvalidWeights as exc:
                raise JobFailed(f"the trainer wrote unusable weights: {exc}") from None
        elif not (out / "adapter_model.safetensors").is_file():
            raise JobFailed("the trainer exited without writing an adapter")
        await asyncio.to_thread(shutil.rmtree, work / "base", True)
        return out

    # ------------------------------------------------------------ gate

    async def _gate(self, job: Job, scenario: Scenario, out: Path | None,
                    harnesses: tuple[Harness, Harness] | None = None) -> gates.Verdict:
        """Judge the candidate against the serving release, both answered by the scenario's engine: an adapter
        candidate (`out`) is loaded beside the serving one; a harness candidate (`harnesses`: current, proposed)
        differs in the system prompt only."""
        gate = gates.build(scenario.cfg.gate, self.scenarios_dir)
        binding = scenario.binding
        serving = binding.adapter if binding else None
        if gate.sampling is None:  # generates nothing
            return await gate.evaluate(_no_generate, current=None, candidate=None)
        engine, name = scenario.engine, f"candidate-{job.id}"
        inline = scenario.cfg.harness.inline_skills
        blocks = {"current": harnesses[0].prompt_block(inline_skills=inline),
                  "candidate": harnesses[1].prompt_block(inline_skills=inline)} if harnesses else {}

        async def generate(messages: list[dict[str, Any]], side: str | None, sampling: gates.Sampling,
                           seed: int) -> str:
            req = ChatRequest(messages=messages, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                              seed=seed)
            adapter = side
            if harnesses is not None:  # both sides use the serving adapter; the harness is what differs
                add_system_text(req, blocks[str(side)])
                adapter = serving
            return await _answer(engine, req, adapter, scenario.cfg.serve.request_timeout_s)

        width = max(2, scenario.cfg.model.max_batch)  # both sides' requests in the engine's batches
        if harnesses is not None:
            with self.registry.using(engine, serving):
                return await gate.evaluate(generate, current="current", candidate="candidate", concurrency=width)
        assert out is not None
        model = {k: v for k, v in dataclasses.asdict(scenario.cfg.model).items() if k != "max_batch"}
        known: gates.KnownScores | None = None
        # reused scores stand for re-generated ones only where sampling is reproducible: greedy, or the worker,
        # which samples each request with its own seeded generator
        if gate.reuse_current and binding is not None and (gate.sampling.temperature == 0 or
                                                           model["engine"] == "worker"):
            key, release = serving_key(binding), binding.release if binding.artifact is not None else None

            async def remembered(digest: str) -> list[float] | None:
                return await asyncio.to_thread(self.scores.known, key, release, digest)

            known = remembered

        with self.registry.using(engine, serving):  # held from before the load: the serving adapter stays
            await engine.load_adapter(name, out)
            try:
                verdict = await gate.evaluate(generate, current=serving, candidate=name, concurrency=width,
                                              context={"prompts": "raw", "model": model}, known_current=known)
            finally:
                with contextlib.suppress(EngineError, EngineUnavailable):
                    await engine.unload_adapter(name)
        if binding is not None and not verdict.current_reused and verdict.current_mean is not None:
            self.scores.remember(serving_key(binding), verdict.fingerprint, [p["current"] for p in verdict.per_task])
        return verdict

    def _candidate_cfg(self, job: Job, scenario: Scenario, folder: Path) -> ModelConfig:
        """The scenario's model, as one engine of its own on `folder`, outside the router."""
        return dataclasses.replace(scenario.cfg.model, name=f"{scenario.cfg.model.name}-candidate-{job.id}",
                                   source=None, path=str(folder), url=None, replicas=1, workers=[])

    async def _push_engine(self, stack: contextlib.AsyncExitStack, job: Job, scenario: Scenario, spec_path: Path,
                           doc: dict[str, Any]) -> Engine:
        """An engine for the trainer to push its weights to (slime's external engine): the weights the job
        starts from, launched for the job and stopped after its gate; its address goes into the spec."""
        cfg = self._candidate_cfg(job, scenario, Path(doc["base_model"]))
        engine = await stack.enter_async_context(self.registry.borrow(cfg))
        await _until_ready(engine, cfg.startup_timeout_s, "push target", detail=True)
        url = str(engine.describe().get("url") or "")
        if not url:
            raise JobFailed("the engine for the trainer's pushes has no HTTP address")
        doc["engines"] = [url.removeprefix("http://")]
        await asyncio.to_thread(spec_path.write_text, json.dumps(doc))
        return engine

    async def _check_pushed(self, engine: Engine, version: str, out: Path) -> None:
        """The gate judges what the trainer pushed only if its last push arrived (the engine reports that weight
        version); else the engine loads the checkpoint the trainer saved."""
        reported = await engine.adopt_weights(out)  # type: ignore[attr-defined]
        if reported == version:
            log.info("the trainer's last push (weight version %s) is on the gate's engine", version)
            return
        log.warning("the gate's engine reports weight version %s, not the trainer's last push %s: loading the "
                    "checkpoint it saved", reported, version)

        async def nothing_in_flight(weights: str | None) -> None:
            return None

        await engine.swap_weights(out, version, None, lambda: None, nothing_in_flight)  # type: ignore[attr-defined]

    async def _gate_weights(self, job: Job, scenario: Scenario, out: Path,
                            pushed: Engine | None = None) -> gates.Verdict:
        """Judge a full-weights candidate: the serving side answers on the scenario's engine, the candidate on an
        engine of its own (the one the trainer pushed to, or one launched on the candidate's folder for the gate
        and stopped after it); serving is not touched."""
        gate = gates.build(scenario.cfg.gate, self.scenarios_dir)
        if gate.sampling is None:
            return await gate.evaluate(_no_generate, current=None, candidate=None)
        binding = scenario.binding
        serving = binding.adapter if binding else None
        cfg = self._candidate_cfg(job, scenario, out)
        async with contextlib.AsyncExitStack() as stack:
            candidate: Engine = pushed if pushed is not None else \
                await stack.enter_async_context(self.registry.borrow(cfg))
            await _until_ready(candidate, cfg.startup_timeout_s, "candidate's", detail=True)

            async def generate(messages: list[dict[str, Any]], side: str | None, sampling: gates.Sampling,
                               seed: int) -> str:
                req = ChatRequest(messages=messages, max_tokens=sampling.max_tokens,
                                  temperature=sampling.temperature, seed=seed)
                if side == "candidate":
                    return await _answer(candidate, req, None, scenario.cfg.serve.request_timeout_s)
                return await _answer(scenario.engine, req, serving, scenario.cfg.serve.request_timeout_s)

            width = max(2, scenario.cfg.model.max_batch)
            with self.registry.using(scenario.engine, serving):
                return await gate.evaluate(generate, current="current", candidate="candidate", concurrency=width)

    # ------------------------------------------------------------ harness candidates

    async def _harness_job(self, job: Job, scenario: Scenario, spec: HarnessJob, head: Release) -> None:
        """Propose (an LLM call), validate, gate by paired comparison, commit a harness release."""
        binding = scenario.binding
        current = binding.harness if binding is not None else None
        if current is None:
            raise JobFailed("the scenario has no harness to evolve (set harness.dir in its file)")
        await self._save(job, "propose")
        answer = await self._propose(scenario, spec)
        try:
            mutations = spec.edit(answer, current)
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
        await self._save(job, "gate")
        verdict = await self._gate(job, scenario, None, harnesses=(current, proposed))
        job.verdict = verdict.as_meta()
        await self._save(job, "publish")
        meta = {"source": job.recipe, "job": job.id, "summary": proposed.summary(current),
                "metrics": {"mutations": len(mutations)}, "receipts": job.receipts,
                "reports": sorted({r for s in spec.samples for r in s.reports}), "mutations": mutations,
                "params": {**_recipe_params(scenario), "max_tokens": spec.max_tokens,
                           "temperature": spec.temperature},
                "proposal": _clipped(answer)}
        work = self.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        await asyncio.to_thread(proposed.render, work / "harness")
        await self._finish(job, scenario, Candidate("harness", meta, artifact=work / "harness", built_on=head.id,
                                                    verdict=job.verdict), verdict)

    # ------------------------------------------------------------ harness searches

    def archive_path(self, scenario: str) -> Path:
        """A search recipe's archive: one JSON file per scenario."""
        return self.jobs.root.parent / "archives" / f"{scenario}.json"

    async def _search_job(self, job: Job, scenario: Scenario, spec: HarnessSearch, head: Release) -> None:
        """Drive the recipe's search (every Ask answered here, a round at a time, as wide as the engine's batch),
        keep its archive, then gate and commit what it proposes, as any harness candidate."""
        binding = scenario.binding
        current = binding.harness if binding is not None else None
        if current is None:
            raise JobFailed("the scenario has no harness to evolve (set harness.dir in its file)")
        path = self.archive_path(job.scenario)
        archive = json.loads(await asyncio.to_thread(path.read_text)) if path.is_file() else None
        ctx = SearchContext(archive, current, lambda rel: load_tasks(self.scenarios_dir / rel))
        await self._save(job, "search")
        search = spec.run(ctx)
        calls = 0
        async with contextlib.AsyncExitStack() as stack:
            reflector = await self._reflector(stack, scenario, spec.reflector)
            answers: list[str] | None = None
            while True:  # the recipe's steps run off the event loop (task files, user scorers)
                asks, found = await asyncio.to_thread(_advance, search, answers)
                if found is not None:
                    break
                answers = await self._answer_all(scenario, asks, reflector)
                calls += len(asks)
                job.progress = {"calls": calls}
        await asyncio.to_thread(write_json, path, found.archive)
        job.metrics = {**found.metrics, "calls": calls, "reason": found.reason}
        if found.proposed is None:
            job.state, job.error = "skipped", found.reason
            return
        await self._save(job, "gate")
        verdict = await self._gate(job, scenario, None, harnesses=(current, found.proposed))
        job.verdict = verdict.as_meta()
        await self._save(job, "publish")
        meta = {"source": job.recipe, "job": job.id, "summary": f"{found.proposed.summary(current)}: {found.reason}",
                "metrics": found.metrics, "receipts": job.receipts,
                "reports": sorted({r for s in spec.samples for r in s.reports}), "mutations": found.mutations,
                "params": _recipe_params(scenario)}
        if found.proposal:
            meta["proposal"] = _clipped(found.proposal)
        work = self.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        await asyncio.to_thread(found.proposed.render, work / "harness")
        await self._finish(job, scenario, Candidate("harness", meta, artifact=work / "harness", built_on=head.id,
                                                    verdict=job.verdict), verdict)

    async def _reflector(self, stack: contextlib.AsyncExitStack, scenario: Scenario,
                         spec: Any) -> Callable[[Ask], Awaitable[str]]:
        """How a reflection Ask is answered: the scenario's engine and release, a model config's engine, or a
        Python function pkg.mod:fn(messages) -> str."""
        timeout = scenario.cfg.serve.request_timeout_s
        if isinstance(spec, str):
            fn = plugins.resolve({}, spec, "reflector")

            async def call(ask: Ask) -> str:
                return str(await asyncio.to_thread(fn, ask.messages))

            return call
        if isinstance(spec, dict):
            try:
                cfg = ModelConfig(**spec)
            except TypeError as exc:
                raise JobFailed(f"recipe.params.reflector: {exc}") from None
            engine = await stack.enter_async_context(self.registry.borrow(cfg))
            adapter, startup_s = None, cfg.startup_timeout_s
        else:
            engine, adapter = scenario.engine, scenario.binding.adapter if scenario.binding else None
            startup_s = scenario.cfg.model.startup_timeout_s
        await _until_ready(engine, startup_s, "reflection")
        stack.enter_context(self.registry.using(engine, adapter))

        async def ask_engine(ask: Ask) -> str:
            req = ChatRequest(messages=ask.messages, max_tokens=ask.max_tokens, temperature=ask.temperature,
                              seed=ask.seed)
            return await _answer(engine, req, adapter, timeout)

        return ask_engine

    async def _answer_all(self, scenario: Scenario, asks: list[Ask],
                          reflector: Callable[[Ask], Awaitable[str]]) -> list[str]:
        """Every Ask's answer, in order: at most the engine's batch at once."""
        engine, serving = scenario.engine, scenario.binding.adapter if scenario.binding else None
        inline = scenario.cfg.harness.inline_skills
        limit = asyncio.Semaphore(max(2, scenario.cfg.model.max_batch))

        async def one(ask: Ask) -> str:
            async with limit:
                if ask.reflect:
                    return await reflector(ask)
                req = ChatRequest(messages=ask.messages, max_tokens=ask.max_tokens, temperature=ask.temperature,
                                  seed=ask.seed)
                if ask.harness is not None:
                    add_system_text(req, ask.harness.prompt_block(inline_skills=inline))
                return await _answer(engine, req, serving, scenario.cfg.serve.request_timeout_s)

        with self.registry.using(engine, serving):
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                tasks = [group.create_task(one(a)) for a in asks]
            return [t.result() for t in tasks]

    async def _propose(self, scenario: Scenario, spec: HarnessJob) -> str:
        """The proposer's answer: the scenario's own engine and release, or the model named in the recipe."""
        req = ChatRequest(messages=spec.messages, max_tokens=spec.max_tokens, temperature=spec.temperature)
        async with contextlib.AsyncExitStack() as stack:
            if spec.proposer is None:
                engine, adapter = scenario.engine, scenario.binding.adapter if scenario.binding else None
                startup_s = scenario.cfg.model.startup_timeout_s
            else:
                try:
                    cfg = ModelConfig(**spec.proposer)
                except TypeError as exc:
                    raise JobFailed(f"recipe.params.proposer: {exc}") from None
                engine, adapter, startup_s = await stack.enter_async_context(self.registry.borrow(cfg)), None, \
                    cfg.startup_timeout_s
            await _until_ready(engine, startup_s, "proposer")
            return await _answer(engine, req, adapter, scenario.cfg.serve.request_timeout_s)


def _recipe_params(scenario: Scenario) -> dict[str, Any]:
    """What a release keeps of the job that made it (its `params`): the recipe and its settings as declared."""
    return {"recipe": scenario.cfg.recipe.name, "recipe_params": json.loads(json.dumps(scenario.cfg.recipe.params,
                                                                                       default=str))}


def _clipped(text: str) -> str:
    """A proposer's answer as a release keeps it: at most PROPOSAL_CHARS characters."""
    if len(text) <= PROPOSAL_CHARS:
        return text
    return f"{text[:PROPOSAL_CHARS]}\n[... {len(text) - PROPOSAL_CHARS} more characters]"


def _saved(out: Path, job: Job) -> bool:
    """Whether a stopped trainer left a complete candidate (its folder appears whole, metrics.json inside); the
    job's metrics are then the ones saved with it (marked `stopped`)."""
    try:
        saved = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    metrics = saved.get("metrics") if isinstance(saved, dict) else None
    if not isinstance(metrics, dict):
        return False
    job.metrics = metrics
    return True


def _advance(search: Search, answers: list[str] | None) -> tuple[list[Ask], Found | None]:
    """One step of a recipe's search: its next asks, or how it ended (StopIteration cannot cross a thread)."""
    try:
        return (next(search) if answers is None else search.send(answers)), None
    except StopIteration as done:
        return [], done.value


async def _until_ready(engine: Engine, startup_s: float, what: str, detail: bool = False) -> None:
    """Wait for an engine a job borrows (JobFailed once it failed or `startup_s` passed); `detail` adds its
    last error to the message."""
    deadline = time.monotonic() + startup_s
    while not engine.ready:
        state = engine.describe()
        if state["state"] == "failed" or time.monotonic() > deadline:
            raise JobFailed(f"the {what} engine is {state['state']}"
                            + (f": {state.get('last_error')}" if detail else ""))
        await asyncio.sleep(0.25)


async def _answer(engine: Engine, req: ChatRequest, adapter: str | None, timeout_s: float) -> str:
    """The text of one non-streamed answer from `engine`."""
    async for event in engine.generate(req, stream=False, adapter=adapter, timeout_s=timeout_s):
        if isinstance(event, Completion):
            return event.text or ""
    raise JobFailed("the engine ended without an answer")


async def _no_generate(messages: list[dict[str, Any]], adapter: str | None, sampling: gates.Sampling,
                       seed: int) -> str:
    raise JobFailed("the always gate generates nothing")
