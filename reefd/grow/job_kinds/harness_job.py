"""The harness and search job kinds: a proposer's answer edited into harness mutations (a HarnessJob), or a recipe's
search driven round by round with every Ask answered here (a HarnessSearch, e.g. GEPA); both refused before the
gate when they touch what only an operator may change (extensions, a role's tools), else gated by a paired
comparison on the scenario's engine, where the sides differ in the system prompt only. Knows nothing about trainers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from reefd import plugins
from reefd.commit import gates
from reefd.commit.gates.tasks import load_tasks
from reefd.engines import Engine, ModelConfig
from reefd.grow.job_kinds import JobContext, JobFailed, Made, answer, clipped, recipe_params, until_ready
from reefd.grow.job_store import Job
from reefd.grow.recipes import Ask, Found, HarnessJob, HarnessSearch, RecipeError, Search, SearchContext
from reefd.harness import Harness, HarnessError
from reefd.ops.files import write_json
from reefd.serve.scenarios import Scenario

log = logging.getLogger("reefd.grow.runner")

Reflector = Callable[[Ask], Awaitable[str]]


class HarnessProduct:
    """What the harness and search kinds share: the serving harness, engines, the rendered candidate, the gate."""

    def __init__(self, runner: JobContext) -> None:
        self.runner = runner

    @staticmethod
    def serving(scenario: Scenario) -> Harness:
        """The harness the scenario serves, which the job evolves."""
        current = scenario.binding.harness if scenario.binding is not None else None
        if current is None:
            raise JobFailed("the scenario has no harness to evolve (set harness.dir in its file)")
        return current

    async def engine(self, stack: contextlib.AsyncExitStack, scenario: Scenario, model: dict[str, Any] | None,
                     key: str, what: str) -> tuple[Engine, str | None]:
        """The engine (and adapter) a recipe's `key` names, ready: the scenario's own and its release (None), or a
        `model:` config's engine, borrowed until `stack` closes."""
        if model is None:
            engine, adapter = scenario.engine, scenario.binding.adapter if scenario.binding else None
            startup_s = scenario.cfg.model.startup_timeout_s
        else:
            try:
                cfg = ModelConfig(**model)
            except TypeError as exc:
                raise JobFailed(f"recipe.params.{key}: {exc}") from None
            engine, adapter = await stack.enter_async_context(self.runner.registry.borrow(cfg)), None
            startup_s = cfg.startup_timeout_s
        await until_ready(engine, startup_s, what)
        return engine, adapter

    @staticmethod
    def refusal(current: Harness, proposed: Harness) -> str | None:
        """Why a recipe's candidate may not even be gated: it adds, changes or removes an extension (an MCP server or
        a hook) or a role's tools, which only an operator may do (Harness.operator_only). A recipe learns from what
        users and verifiers wrote, and that text can ask for anything; None when the candidate changes neither."""
        change = proposed.operator_only(current)
        if change is None:
            return None
        return (f"candidate refused before the gate: it {change}; a recipe never changes extensions or a role's "
                "tools (those are the operator's, from the scenario's harness folder)")

    async def made(self, job: Job, current: Harness, proposed: Harness, meta: dict[str, Any]) -> Made | None:
        """The proposed harness, rendered in the job's folder, with what its release keeps; None (the job skipped,
        with the reason) for a candidate refused before its gate (refusal())."""
        refused = self.refusal(current, proposed)
        if refused is not None:
            log.warning("%s %s: %s", job.scenario, job.id, refused)
            job.state, job.error = "skipped", refused
            return None
        work = self.runner.jobs.workdir(job)
        await asyncio.to_thread(shutil.rmtree, work, True)
        await asyncio.to_thread(proposed.render, work / "harness")
        return Made("harness", {"source": job.recipe, "job": job.id, **meta}, work / "harness", (current, proposed))

    def resumed(self, scenario: Scenario, made: Made) -> Made:
        """The saved harness against the one that serves (the commit refuses it if the head moved meanwhile)."""
        try:
            proposed = Harness.from_dir(made.artifact)
        except HarnessError as exc:
            raise JobFailed(f"the saved candidate harness is unreadable: {exc}") from None
        return dataclasses.replace(made, harnesses=(self.serving(scenario), proposed))

    async def gate(self, job: Job, scenario: Scenario, made: Made, gate: gates.Gate) -> gates.Verdict:
        """Both sides answered by the scenario's engine and serving adapter; the harness is what differs. Each view
        the candidate changes is judged (views()), and the candidate passes only if every one passes."""
        assert made.harnesses is not None and gate.sampling is not None
        serving = scenario.binding.adapter if scenario.binding else None
        verdict: gates.Verdict | None = None
        for view in views(scenario, *made.harnesses):
            blocks = {side: scenario.harness_text(h, view) for side, h in zip(("current", "candidate"),
                                                                               made.harnesses, strict=True)}

            async def generate(messages: list[dict[str, Any]], side: str | None, sampling: gates.Sampling,
                               seed: int, blocks: dict[str, str] = blocks) -> str:
                return await answer(scenario, scenario.engine, serving, messages, sampling.max_tokens,
                                    sampling.temperature, seed, blocks[str(side)])

            with self.runner.registry.using(scenario.engine, serving):
                verdict = await gate.evaluate(generate, current="current", candidate="candidate",
                                              concurrency=max(2, scenario.cfg.model.max_batch))
            if view is not None:
                verdict = dataclasses.replace(verdict, reason=f"as subagent {view}: {verdict.reason}")
            if not verdict.passed:
                break
        assert verdict is not None
        return verdict


def views(scenario: Scenario, current: Harness, candidate: Harness) -> list[str | None]:
    """What a gate judges a harness candidate as: None, the requests reefd serves, when the text it adds to them
    changes; and each role the candidate creates or changes, as that role's subagent (Scenario.harness_text). A
    candidate that changes neither (an extension, a prompt no request applies) is judged on served requests, where
    both sides answer alike."""
    out: list[str | None] = []
    if scenario.harness_text(current) != scenario.harness_text(candidate):
        out.append(None)
    out += [e.id for e in candidate.of_kind("role") if current.get(("role", e.id)) != e]
    return out or [None]


@dataclasses.dataclass
class Proposal:
    """A proposer's edit: the harness it makes (None: nothing to publish, `reason` says why) and what a release
    keeps of it (summary, metrics, mutations, params, the proposer's answer, the reports it read)."""

    harness: Harness | None
    reason: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class HarnessKind(HarnessProduct):
    async def make(self, job: Job, scenario: Scenario, spec: HarnessJob, stack: contextlib.AsyncExitStack
                   ) -> Made | None:
        current = self.serving(scenario)
        await self.runner.save(job, "propose")
        found = await self.propose(job, scenario, spec, current)
        if found.harness is None:
            job.state, job.error = "skipped", found.reason
            return None
        return await self.made(job, current, found.harness, {**found.meta, "receipts": job.receipts})

    async def propose(self, job: Job, scenario: Scenario, spec: HarnessJob, current: Harness) -> Proposal:
        """Ask the proposer (the scenario's own engine and release, or the recipe's proposer model) and validate its
        answer into an edit of `current`."""
        async with contextlib.AsyncExitStack() as proposer:
            engine, adapter = await self.engine(proposer, scenario, spec.proposer, "proposer", "proposer")
            said = await answer(scenario, engine, adapter, spec.messages, spec.max_tokens, spec.temperature)
        job.metrics = {"proposer_answer": said[:4000]}
        try:
            mutations = spec.edit(said, current)
            proposed = current.apply(mutations)
        except (RecipeError, HarnessError) as exc:
            return Proposal(None, f"proposal refused: {exc}")
        if not mutations or proposed.files() == current.files():
            return Proposal(None, "the proposer proposed no change")
        job.metrics = {"mutations": len(mutations), "proposer_answer": said[:4000]}
        return Proposal(proposed, meta={
            "summary": proposed.summary(current), "metrics": {"mutations": len(mutations)},
            "reports": sorted({r for s in spec.samples for r in s.reports}), "mutations": mutations,
            "params": {**recipe_params(scenario), "max_tokens": spec.max_tokens, "temperature": spec.temperature},
            "proposal": clipped(said)})


class SearchKind(HarnessProduct):
    async def make(self, job: Job, scenario: Scenario, spec: HarnessSearch, stack: contextlib.AsyncExitStack
                   ) -> Made | None:
        """Drive the recipe's search (a round at a time, as wide as the engine's batch) and keep its archive."""
        current = self.serving(scenario)
        path = self.runner.jobs.root.parent / "archives" / f"{job.scenario}.json"  # the recipe's archive
        archive = json.loads(await asyncio.to_thread(path.read_text)) if path.is_file() else None
        ctx = SearchContext(archive, current, lambda rel: load_tasks(self.runner.scenarios_dir / rel))
        await self.runner.save(job, "search")
        search = spec.run(ctx)
        calls = 0
        async with contextlib.AsyncExitStack() as engines:
            reflector = await self._reflector(engines, scenario, spec.reflector)
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
            return None
        meta = {"summary": f"{found.proposed.summary(current)}: {found.reason}", "metrics": found.metrics,
                "receipts": job.receipts, "reports": sorted({r for s in spec.samples for r in s.reports}),
                "mutations": found.mutations, "params": recipe_params(scenario)}
        if found.proposal:
            meta["proposal"] = clipped(found.proposal)
        return await self.made(job, current, found.proposed, meta)

    async def _reflector(self, stack: contextlib.AsyncExitStack, scenario: Scenario, spec: Any) -> Reflector:
        """How a reflection Ask is answered: the scenario's engine and release, a model config's engine, or a
        Python function pkg.mod:fn(messages) -> str."""
        if isinstance(spec, str):
            fn = plugins.resolve({}, spec, "reflector")

            async def call(ask: Ask) -> str:
                return str(await asyncio.to_thread(fn, ask.messages))

            return call
        engine, adapter = await self.engine(stack, scenario, spec, "reflector", "reflection")
        stack.enter_context(self.runner.registry.using(engine, adapter))

        async def ask_engine(ask: Ask) -> str:
            return await answer(scenario, engine, adapter, ask.messages, ask.max_tokens, ask.temperature, ask.seed)

        return ask_engine

    async def _answer_all(self, scenario: Scenario, asks: list[Ask], reflector: Reflector) -> list[str]:
        """Every Ask's answer, in order: at most the engine's batch at once."""
        engine, serving = scenario.engine, scenario.binding.adapter if scenario.binding else None
        limit = asyncio.Semaphore(max(2, scenario.cfg.model.max_batch))

        async def one(ask: Ask) -> str:
            async with limit:
                if ask.reflect:
                    return await reflector(ask)
                system = scenario.harness_text(ask.harness, ask.role) if ask.harness is not None else None
                return await answer(scenario, engine, serving, ask.messages, ask.max_tokens, ask.temperature,
                                    ask.seed, system)

        with self.runner.registry.using(engine, serving):
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                tasks = [group.create_task(one(a)) for a in asks]
            return [t.result() for t in tasks]


def _advance(search: Search, answers: list[str] | None) -> tuple[list[Ask], Found | None]:
    """One step of a recipe's search: its next asks, or how it ended (StopIteration cannot cross a thread)."""
    try:
        return (next(search) if answers is None else search.send(answers)), None
    except StopIteration as done:
        return [], done.value
