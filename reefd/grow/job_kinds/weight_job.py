"""The weights job kind: a recipe's WeightJob written as a trainer spec, trained on the scenario's trainer backend
(reefd/grow/backends), and gated as an adapter beside the serving one or as full weights on an engine of its own.
Knows the trainer spec and the backends' declared abilities; nothing about recipes' losses.
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

from reefd import plugins
from reefd.commit import gates
from reefd.commit.proofs import probe_of, stamped
from reefd.commit.weights import InvalidWeights, check_weights
from reefd.engines import Engine, EngineError, EngineUnavailable, ModelConfig, Proves, seeded_sampling
from reefd.engines.proof import Fingerprint
from reefd.grow.backends import PushesWeights, Stoppable, TrainerBackend, TrainerTimeout
from reefd.grow.job_kinds import JobContext, JobFailed, Made, answer, recipe_params, until_ready
from reefd.grow.job_store import Job
from reefd.grow.recipes import WeightJob
from reefd.serve.scenarios import Binding, Scenario

log = logging.getLogger("reefd.grow.runner")

SPEC_PARAMS = ("objective", "settings", "seed", "lora", "optim", "target")  # the trainer spec's, kept in `params`


def serving_key(binding: Binding) -> str:
    """What a gate's scores of the serving side belong to: its adapter's tree, or the base model, on its weights."""
    adapter = binding.artifact if binding.adapter is not None and binding.artifact is not None else "base"
    return adapter if binding.weights is None else f"{adapter}@{binding.weights}"


class WeightsKind:
    def __init__(self, runner: JobContext) -> None:
        self.runner = runner

    async def make(self, job: Job, scenario: Scenario, spec: WeightJob, stack: contextlib.AsyncExitStack
                   ) -> Made | None:
        job.skipped = [*spec.skipped, *job.skipped]  # the recipe's, then those past max_staleness
        await self.runner.save(job, "train")
        return await self.train(job, scenario, await self.write_spec(job, scenario, spec), stack)

    async def write_spec(self, job: Job, scenario: Scenario, spec: WeightJob) -> Path:
        """The job's folder with its trainer spec (and the weights it trains on, when a weights release serves)."""
        assert job.built_on is not None
        chain, model_dir = self.runner.chain, scenario.engine.model_folder()
        if model_dir is None:
            raise JobFailed("the scenario's model is not prepared yet")
        work = self.runner.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        work.mkdir(parents=True)
        artifacts = await asyncio.to_thread(chain.artifacts, job.built_on)
        if "weights" in artifacts:  # train on the weights served
            model_dir = await asyncio.to_thread(chain.materialize, job.built_on, work / "base", "weights")
        init = None
        if "adapter" in artifacts:  # continue from what serves
            init = await asyncio.to_thread(chain.materialize, job.built_on, work / "init", "adapter")
        fault = scenario.cfg.recipe.fault  # tests only: the trainer fails on purpose
        doc = {"job": job.id, "objective": spec.objective, "settings": spec.settings, "seed": spec.seed,
               "base_model": str(model_dir), "init_adapter": str(init) if init else None,
               "output_dir": str(work / "candidate"), "lora": spec.lora, "optim": spec.optim, "target": spec.target,
               "samples": [{k: v for k, v in dataclasses.asdict(s).items() if k != "context"} for s in spec.samples],
               **({"fault": {"kind": fault["kind"], "hold": fault.get("hold")}} if fault else {})}
        if scenario.cfg.release.proof.enabled and isinstance(scenario.engine, Proves):  # the trainer fingerprints it
            doc["proof"] = {**probe_of(scenario.cfg.release.proof), "tokenizer": str(scenario.engine.model_folder())}
        spec_path = work / "spec.json"
        await asyncio.to_thread(spec_path.write_text, json.dumps(doc))
        return spec_path

    async def train(self, job: Job, scenario: Scenario, spec_path: Path, stack: contextlib.AsyncExitStack) -> Made:
        """Train the written spec; the candidate and what its release keeps."""
        assert job.built_on is not None
        doc = json.loads(await asyncio.to_thread(spec_path.read_text))
        backend = self.runner.backends.get(scenario.cfg.recipe.backend)
        # a full HF model folder: asked for by the recipe, or what the backend always trains (slime)
        full = doc.get("target") == "full" or backend.full_weights
        # weights the engine cannot serve are refused before they are trained (their config is the base's)
        if full and (why := await asyncio.to_thread(scenario.weights_refusal, Path(doc["base_model"]))) is not None:
            raise JobFailed(f"not trained: scenario {scenario.name!r} cannot serve full weights of its model: {why}")
        weights = await asyncio.to_thread(self.runner.chain.weights, job.built_on)  # what it is trained on
        # the engine the trainer pushes its weights to, where the gate then judges them
        pushed = await self._push_engine(stack, job, scenario, spec_path, doc) if backend.pushes else None
        fingerprint: dict[str, Any] = {}
        out = await self._run(job, scenario, backend, spec_path, full, fingerprint)
        if pushed is not None:
            assert isinstance(backend, PushesWeights)
            await _check_pushed(pushed, backend.pushed_version(doc), out)
        meta = {"source": job.recipe, "job": job.id, "summary": f"{job.recipe} on {len(job.receipts)} records",
                "metrics": job.metrics, "receipts": job.receipts,
                "reports": sorted({r for s in doc["samples"] for r in s.get("reports") or ()}),
                "params": {**recipe_params(scenario), "backend": scenario.cfg.recipe.backend,
                           **{k: doc.get(k) for k in SPEC_PARAMS}},
                **({"skipped": list(job.skipped)} if job.skipped else {})}
        # an adapter serves only on the weights it was trained on; full weights say what they started from
        meta["trained_on" if full else "weights"] = weights
        proof = Fingerprint.from_json(fingerprint.get("fingerprint"))
        if proof is not None and "proof" in doc:
            meta["proof"] = stamped(proof, {k: v for k, v in doc["proof"].items() if k != "tokenizer"})
        return Made("weights" if full else "adapter", meta, out, pushed=pushed)

    async def _run(self, job: Job, scenario: Scenario, backend: TrainerBackend, spec_path: Path, full: bool,
                   fingerprint: dict[str, Any]) -> Path:
        """Run the spec on the scenario's trainer backend; the candidate folder (an adapter, or a full HF model)."""
        work, out, error = spec_path.parent, spec_path.parent / "candidate", None

        def on_event(event: dict[str, Any]) -> None:
            nonlocal error
            if event.get("event") == "progress":
                job.progress = {k: v for k, v in event.items() if k != "event"}
            elif event.get("event") == "done":
                job.metrics = dict(event.get("metrics") or {})
            elif event.get("event") == "proof":
                fingerprint.update(event)
            elif event.get("event") == "error":
                error = str(event.get("reason"))

        job.detachable = backend.detachable
        if job.detachable:  # on disk before the job starts, so even a killed reefd's successor follows it
            await self.runner.save(job)
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

    async def stop(self, job: Job) -> str | None:
        """Stop the job's trainer where it runs, when its backend runs jobs beyond reefd's task (a cluster); what
        went wrong, or None."""
        scenario = self.runner.registry.scenarios.get(job.scenario)
        if scenario is None:
            return "its scenario is no longer served, so its trainer was not stopped on the cluster"
        try:
            backend = self.runner.backends.get(scenario.cfg.recipe.backend)
        except plugins.PluginError as exc:
            return f"its trainer was not stopped on the cluster: {exc}"
        spec = self.runner.jobs.workdir(job) / "spec.json"
        if not isinstance(backend, Stoppable) or not spec.is_file():  # not on a cluster, or it never got there
            return None
        return await backend.stop(spec)

    def resumed(self, scenario: Scenario, made: Made) -> Made:
        return made  # an engine the trainer pushed to is gone: the gate launches one on the candidate's folder

    async def gate(self, job: Job, scenario: Scenario, made: Made, gate: gates.Gate) -> gates.Verdict:
        return await (self._gate_full(job, scenario, made, gate) if made.kind == "weights"
                      else self.gate_adapter(job, scenario, made.artifact, gate))

    async def gate_adapter(self, job: Job, scenario: Scenario, out: Path, gate: gates.Gate,
                           systems: tuple[str, str] | None = None) -> gates.Verdict:
        """The adapter candidate loaded beside the serving one; both answered by the scenario's engine. `systems`:
        the serving side's system text and the candidate's (a bundle's harnesses); their scores are not kept."""
        assert gate.sampling is not None
        binding, registry, scores = scenario.binding, self.runner.registry, self.runner.scores
        serving = binding.adapter if binding else None
        engine, name = scenario.engine, f"candidate-{job.id}"

        async def generate(messages: list[dict[str, Any]], adapter: str | None, sampling: gates.Sampling,
                           seed: int) -> str:
            system = None if systems is None else systems[1] if adapter == name else systems[0]
            return await answer(scenario, engine, adapter, messages, sampling.max_tokens, sampling.temperature, seed,
                                system)

        model = {k: v for k, v in dataclasses.asdict(scenario.cfg.model).items() if k != "max_batch"}
        known: gates.KnownScores | None = None
        # reused scores stand for re-generated ones only where sampling is reproducible: greedy, or an engine
        # that samples each request with its own seeded generator
        if systems is None and gate.reuse_current and binding is not None and (
                gate.sampling.temperature == 0 or seeded_sampling(scenario.cfg.model)):
            key, release = serving_key(binding), binding.release if binding.artifact is not None else None

            async def remembered(digest: str) -> list[float] | None:
                return await asyncio.to_thread(scores.known, key, release, digest)

            known = remembered

        with registry.using(engine, serving):  # held from before the load: the serving adapter stays
            await engine.load_adapter(name, out)
            try:
                verdict = await gate.evaluate(generate, current=serving, candidate=name,
                                              concurrency=max(2, scenario.cfg.model.max_batch),
                                              context={"prompts": "raw", "model": model}, known_current=known)
            finally:
                with contextlib.suppress(EngineError, EngineUnavailable):
                    await engine.unload_adapter(name)
        if systems is None and binding is not None and not verdict.current_reused and verdict.current_mean is not None:
            scores.remember(serving_key(binding), verdict.fingerprint, [p["current"] for p in verdict.per_task])
        return verdict

    async def _gate_full(self, job: Job, scenario: Scenario, made: Made, gate: gates.Gate) -> gates.Verdict:
        """Full weights: the serving side answers on the scenario's engine, the candidate on an engine of its own
        (the one the trainer pushed to, or one launched on the candidate's folder for the gate and stopped after
        it); serving is not touched."""
        serving = scenario.binding.adapter if scenario.binding else None
        cfg = _candidate_cfg(job, scenario, made.artifact)
        async with contextlib.AsyncExitStack() as stack:
            candidate: Engine = made.pushed if made.pushed is not None else \
                await stack.enter_async_context(self.runner.registry.borrow(cfg))
            await until_ready(candidate, cfg.startup_timeout_s, "candidate's", detail=True)

            async def generate(messages: list[dict[str, Any]], side: str | None, sampling: gates.Sampling,
                               seed: int) -> str:
                engine, adapter = (candidate, None) if side == "candidate" else (scenario.engine, serving)
                return await answer(scenario, engine, adapter, messages, sampling.max_tokens, sampling.temperature,
                                    seed)

            with self.runner.registry.using(scenario.engine, serving):
                return await gate.evaluate(generate, current="current", candidate="candidate",
                                           concurrency=max(2, scenario.cfg.model.max_batch))

    async def _push_engine(self, stack: contextlib.AsyncExitStack, job: Job, scenario: Scenario, spec_path: Path,
                           doc: dict[str, Any]) -> Engine:
        """An engine for the trainer to push its weights to (slime's external engine): the weights the job
        starts from, launched for the job and stopped after its gate; its address goes into the spec."""
        cfg = _candidate_cfg(job, scenario, Path(doc["base_model"]))
        engine = await stack.enter_async_context(self.runner.registry.borrow(cfg))
        await until_ready(engine, cfg.startup_timeout_s, "push target", detail=True)
        url = str(engine.describe().get("url") or "")
        if not url:
            raise JobFailed("the engine for the trainer's pushes has no HTTP address")
        doc["engines"] = [url.removeprefix("http://")]
        await asyncio.to_thread(spec_path.write_text, json.dumps(doc))
        return engine


def _candidate_cfg(job: Job, scenario: Scenario, folder: Path) -> ModelConfig:
    """The scenario's model, as one engine of its own on `folder`, outside the router."""
    return dataclasses.replace(scenario.cfg.model, name=f"{scenario.cfg.model.name}-candidate-{job.id}",
                               source=None, path=str(folder), url=None, replicas=1, workers=[])


async def _check_pushed(engine: Engine, version: str, out: Path) -> None:
    """The gate judges what the trainer pushed only if its last push arrived (the engine reports that weight
    version); else the engine loads the checkpoint the trainer saved."""
    reported = await engine.adopt_weights(out)  # type: ignore[attr-defined]
    if reported == version:
        log.info("the trainer's last push (weight version %s) is on the gate's engine", version)
        return
    log.warning("the gate's engine reports weight version %s, not the trainer's last push %s: loading the "
                "checkpoint it saved", reported, version)
    await engine.swap_weights(out, version, None, lambda: None,  # type: ignore[attr-defined]
                              lambda weights: asyncio.sleep(0))  # nothing in flight to wait for


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
