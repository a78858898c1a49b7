"""Practice rounds: for each scenario with a practice set, a background task answers `tasks_per_round` tasks
(`samples` answers each) with the serving release, on idle engine turns only (with `preempt`, an answer a request
comes in on is stopped and asked again later), then has the verifier check every answer. Each answer is a practice
record (`turn_kind: practice`, never part of a conversation or a canary) and its verdict a `source: verifier`
report, so recipes train on them as on any scored record. A verifier that fails, an engine that is down or a store
that refuses never stops the rounds: it is counted, logged and shown in status. Knows nothing about HTTP, recipes
or the chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from reefd.commit.gates.tasks import GateError, Task
from reefd.engines import EngineError, EngineUnavailable
from reefd.grow.job_store import JobStore
from reefd.grow.practice import settings
from reefd.grow.practice.settings import PracticeConfig
from reefd.grow.practice.verifiers import Verdict, Verifier, VerifierError
from reefd.observe.receipts import new_receipt
from reefd.observe.records import RecordStore, StorageError, UnknownReceipt
from reefd.serve.chat import ChatRequest, Completion, add_system_text
from reefd.serve.scenarios import NotServing, Registry, Scenario
from reefd.serve.turn_record import asked, finish_record, served_by

log = logging.getLogger("reefd.grow.practice")

BIND_POLL_S = 1.0  # how often a scenario that serves no release yet is looked at again
WAITING_POLL_S = 0.25  # how often a round held by max_waiting looks again
_SEEDS = random.SystemRandom()
COUNTS = ("rounds", "answers", "verified", "passed", "failed", "verifier_errors", "answer_errors", "yielded")


class Practice:
    """Every scenario's practice rounds, one background task each, following the scenarios as they reload."""

    def __init__(self, registry: Registry, store: RecordStore, jobs: JobStore, scenarios_dir: Path,
                 state_dir: Path) -> None:
        self.registry, self.store, self.jobs = registry, store, jobs
        self.scenarios_dir, self.state_dir = scenarios_dir, state_dir
        self._runs: dict[str, tuple[PracticeConfig, asyncio.Task[None]]] = {}
        self.stats: dict[str, Counter[str]] = {}
        self.last: dict[str, dict[str, Any]] = {}  # per scenario: the last round's summary, the last error

    def sync(self) -> None:
        """Start, restart (settings changed) or stop each scenario's rounds to match the scenarios now loaded."""
        wanted = {name: s.cfg.practice for name, s in self.registry.scenarios.items()
                  if s.cfg.practice.tasks is not None}
        for name, (cfg, task) in list(self._runs.items()):
            if wanted.get(name) != cfg:
                task.cancel()
                del self._runs[name]
        for name, cfg in wanted.items():
            if name not in self._runs:
                self._runs[name] = (cfg, asyncio.create_task(self._rounds(name, cfg), name=f"practice-{name}"))

    async def close(self) -> None:
        tasks = [task for _, task in self._runs.values()]
        self._runs.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def status(self, name: str) -> dict[str, Any] | None:
        """What practice did for the scenario since reefd started (None: it has no practice set)."""
        run, scenario = self._runs.get(name), self.registry.scenarios.get(name)
        if run is None or scenario is None:
            return None
        cfg, stats = run[0], self.stats.get(name, Counter())
        line = self.registry.admissions.get(id(scenario.engine))
        return {"tasks": cfg.tasks, "verifier": Verifier(cfg.verifier, self.scenarios_dir).describe(),
                **{k: stats[k] for k in COUNTS}, "generating": line.background if line is not None else 0,
                **self.last.get(name, {})}

    # ---------------------------------------------------------------- rounds

    async def _rounds(self, name: str, cfg: PracticeConfig) -> None:
        try:
            tasks = await asyncio.to_thread(settings.load, cfg, self.scenarios_dir)
            verifier = Verifier(cfg.verifier, self.scenarios_dir, hide=(self.state_dir,))
        except (GateError, VerifierError, OSError) as exc:  # checked at load; the file changed since
            self._failed(name, f"practice set or verifier unusable: {exc}")
            return
        order = list(range(len(tasks)))
        random.Random(cfg.seed).shuffle(order)
        cursor, round_no = 0, 0
        while True:
            began = time.monotonic()
            scenario = self.registry.scenarios.get(name)
            if scenario is None:  # removed by a reload: sync() ends this task
                return
            if scenario.binding is None or not scenario.engine.ready:  # no release serves yet, or no engine
                await asyncio.sleep(BIND_POLL_S)
                continue
            if cfg.max_waiting is not None and await self._held(name, cfg.max_waiting):
                await asyncio.sleep(WAITING_POLL_S)
                continue
            picked = [tasks[order[(cursor + i) % len(order)]] for i in range(cfg.tasks_per_round)]
            cursor = (cursor + cfg.tasks_per_round) % len(order)
            round_no += 1
            try:
                await self.round(scenario, cfg, verifier, picked, round_no)
            except Exception:  # a bug must not end practice for good
                log.exception("%s: practice round %d failed", name, round_no)
            await asyncio.sleep(max(0.0, 3600.0 / cfg.rounds_per_hour - (time.monotonic() - began)))

    async def _held(self, name: str, max_waiting: int) -> bool:
        """Whether a batch waits for its job, or that job runs: the next round then answers with the release the
        job makes. (Its records stop waiting when the release is written, a moment before it serves.)"""
        if self.jobs.active(name) is not None:
            return True
        return await asyncio.to_thread(self.store.waiting, name, max_waiting) >= max_waiting

    async def round(self, scenario: Scenario, cfg: PracticeConfig, verifier: Verifier, tasks: list[Task],
                    round_no: int) -> list[Verdict | None]:
        """One round: every (task, sample) answered and verified, `concurrency` at a time; their verdicts (None:
        no answer, the engine or the store failed)."""
        gate = asyncio.Semaphore(cfg.concurrency)
        stats = self.stats.setdefault(scenario.name, Counter())

        async def one(task: Task, sample: int) -> Verdict | None:
            async with gate:
                try:
                    return await self._practise(scenario, cfg, verifier, task, round_no, sample)
                except Exception as exc:  # a bug in one answer's path must not take the round's others with it
                    log.exception("%s: practice on %s failed", scenario.name, task.where)
                    stats["answer_errors"] += 1
                    self._failed(scenario.name, f"practice on {task.where} failed: {exc!r}")
                    return None

        verdicts = await asyncio.gather(*(one(t, k) for t in tasks for k in range(cfg.samples)))
        stats["rounds"] += 1
        done = [v for v in verdicts if v is not None]
        self.last[scenario.name] = {**self.last.get(scenario.name, {}), "last_round": {
            "round": round_no, "at": time.time(), "answers": len(done),
            "passed": sum(v.passed for v in done), "verifier_errors": sum(v.error is not None for v in done)}}
        return verdicts

    async def _practise(self, scenario: Scenario, cfg: PracticeConfig, verifier: Verifier, task: Task,
                        round_no: int, sample: int) -> Verdict | None:
        stats = self.stats.setdefault(scenario.name, Counter())
        try:
            while True:  # asked again, on the next idle turn, while requests stop it
                try:
                    record = await self._answer(scenario, cfg, task, round_no, sample)
                    break
                except Yielded:
                    stats["yielded"] += 1
            await self.store.put_record(record, link=False)
        except (EngineUnavailable, EngineError, NotServing, StorageError) as exc:  # the engine or the store
            stats["answer_errors"] += 1
            self._failed(scenario.name, f"no practice answer: {exc}")
            return None
        stats["answers"] += 1
        verdict = await verifier.verify(record["response"]["text"], task.raw)
        stats["verified"] += 1
        stats["passed" if verdict.passed else "failed"] += 1
        if verdict.error is not None:
            stats["verifier_errors"] += 1
            self._failed(scenario.name, f"verifier failed on {task.where}: {verdict.error}")
        body = {"references": [record["id"]], "score": verdict.score, "report_id": f"verifier-{record['id']}",
                "metadata": {"verifier": verifier.describe(), "task": task.where, "error": verdict.error,
                             **verdict.output}}
        if verdict.feedback:  # what the verifier said of the answer, as a user's feedback reads (SkillClaw reads it)
            body["feedback"] = verdict.feedback
        with contextlib.suppress(UnknownReceipt):  # retention took the record meanwhile
            try:
                await self.store.put_report(scenario.name, body, source="verifier")
            except StorageError as exc:
                self._failed(scenario.name, f"verdict of {record['id']} not stored: {exc}")
        return verdict

    async def _answer(self, scenario: Scenario, cfg: PracticeConfig, task: Task, round_no: int,
                      sample: int) -> dict[str, Any]:
        """The serving release's answer to one task, as a practice record (not stored yet)."""
        seed = _SEEDS.getrandbits(63)  # a new draw each time, restarts included (kept in the record)
        chat = ChatRequest(messages=copy.deepcopy(task.messages), max_tokens=cfg.max_tokens,
                           temperature=cfg.temperature, seed=seed)
        chat.top_logprobs = scenario.capture_top_k
        serving = self.registry.practicing(scenario, cfg.preempt)
        async with serving as binding:
            if binding.harness is not None and scenario.cfg.harness.inject:
                add_system_text(chat, scenario.harness_text(binding.harness))
            receipt = new_receipt()
            record: dict[str, Any] = {
                **served_by(scenario, binding, receipt), "api": "practice", "created_at": time.time(),
                "session": None, "turn": None, "turn_kind": "practice", "previous": None, "tags": {}, "stream": False,
                "practice": {"tasks": cfg.tasks, "task": task.where, "round": round_no, "sample": sample,
                             "seed": seed},
                "request": None, **asked(chat)}
            on_weights = {"weights": binding.weights_version} if scenario.weight_swap is not None else {}
            started = time.monotonic()
            events = scenario.engine.generate(chat, stream=False, timeout_s=scenario.cfg.serve.request_timeout_s,
                                              adapter=binding.adapter, **on_weights)
            # an engine without a line (no turn limits) has nobody to yield to: nothing ever stops the answer
            completion = await _unless(serving.stop or asyncio.Event(), _completion(events))
        if completion is None:
            raise EngineError("the engine ended without a completion")
        finish_record(record, completion, {"text": completion.text or ""}, started, None)
        return record

    def _failed(self, name: str, message: str) -> None:
        log.warning("%s: %s", name, message)
        self.last[name] = {**self.last.get(name, {}), "last_error": {"at": time.time(), "message": message}}


class Yielded(Exception):
    """A request asked for the engine while a practice answer generated: the answer was stopped, to be asked again."""


async def _completion(events: Any) -> Completion | None:
    try:
        completion = None
        async for event in events:
            if isinstance(event, Completion):
                completion = event
        return completion
    finally:
        await events.aclose()


async def _unless(stop: asyncio.Event, work: Awaitable[Completion | None]) -> Completion | None:
    """`work`'s result, unless `stop` is set first: then it is cancelled (its engine request goes with it) and
    Yielded is raised."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Yielded
    return task.result()
