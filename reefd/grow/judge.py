"""The judge: a process reward model that scores a served turn from its next state, off the request path: m sampled
votes on a verdict (and on hindsight hints), stored as a `source: judge` report on the turn. Serving never waits
for it; a judge that is down delays judging. Knows the recipes' JudgeSettings; nothing about training.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from reefd import plugins
from reefd.engines import Engine, EngineError, EngineUnavailable, ModelConfig, build_engine
from reefd.grow.recipes import Judged, JudgeSettings
from reefd.observe.conversations import text_of
from reefd.observe.records import RecordStore, StorageError, UnknownReceipt
from reefd.serve.chat import ChatRequest, Completion
from reefd.serve.scenarios import Registry, Scenario

log = logging.getLogger("reefd.grow.judge")

VERDICT_SYSTEM = """\
You judge one turn of a conversation between a user and an AI assistant. You see the assistant's reply and what \
came next: the user's next message, or the result of a tool the assistant called. Use what came next as evidence \
of whether the reply served the user.
- \\boxed{1}: the reply worked. The user moves on, agrees or thanks, or the tool ran without error.
- \\boxed{-1}: the reply missed. The user corrects it, repeats or rephrases the request, asks for a change, or the \
tool failed.
- \\boxed{0}: what came next says nothing either way.
Think briefly, then end with exactly one of \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

HINT_SYSTEM = """\
You read one turn of a conversation between a user and an AI assistant, and what came next: the user's next \
message, or the result of a tool the assistant called. Decide whether what came next reveals something the \
assistant could have known or done to give a better reply: a preference, a correction, a missing fact.
If it does, answer \\boxed{1}, then write a hint of 1 to 3 sentences addressed to the assistant between \
[HINT_START] and [HINT_END].
If it does not, answer \\boxed{-1} and nothing else."""

_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d+)\s*\}")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def parse_vote(text: Any, allowed: tuple[int, ...] = (1, -1, 0)) -> int | None:
    """The last `\\boxed{n}` of an answer when n is allowed, else None (an invalid vote)."""
    if not isinstance(text, str):
        return None
    found = _BOXED.findall(text)
    if not found:
        return None
    value = int(found[-1])
    return value if value in allowed else None


def parse_hint(text: Any) -> str | None:
    """The last [HINT_START]...[HINT_END] of an answer, stripped."""
    if not isinstance(text, str):
        return None
    found = _HINT.findall(text)
    return found[-1].strip() if found else None


def plurality(votes: list[int | None]) -> int:
    """The most common valid vote; 0 on a tie for the top or when no vote is valid."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def select_hints(answers: list[str | None], limit: int, min_chars: int = 10) -> list[str]:
    """Hints of the votes that answered \\boxed{1}: longer than `min_chars`, deduplicated, shortest first."""
    hints = {h for a in answers if parse_vote(a, (1, -1)) == 1 and (h := parse_hint(a)) and len(h) > min_chars}
    return sorted(hints, key=lambda h: (len(h), h))[:limit]


@dataclass
class JudgeCall:
    """One vote's question, as a function judge receives it (an engine judge gets `messages` only)."""

    kind: str  # "verdict" | "hint"
    vote: int  # 0..m-1
    messages: list[dict[str, Any]]
    response: str  # the judged turn's reply (text; tool calls as name(arguments))
    next_state: list[dict[str, Any]]
    record: dict[str, Any]


def prompt(kind: str, response: str, next_state: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The judge's messages for one vote."""
    following = "\n\n".join(f"[{m.get('role')}] {m.get('content')}" for m in next_state) or "(nothing)"
    question = ("Did the reply serve the user? End with \\boxed{1}, \\boxed{-1} or \\boxed{0}." if kind == "verdict"
                else "Does what came next reveal how the reply could have been better? Answer \\boxed{1} with a "
                     "hint between [HINT_START] and [HINT_END], or \\boxed{-1}.")
    return [{"role": "system", "content": VERDICT_SYSTEM if kind == "verdict" else HINT_SYSTEM},
            {"role": "user", "content": f"The assistant's reply:\n<<<\n{response}\n>>>\n\n"
                                        f"What came next:\n<<<\n{following}\n>>>\n\n{question}"}]


def reply_text(record: dict[str, Any]) -> str:
    """The judged reply: its text, and its tool calls as name(arguments)."""
    messages = record.get("messages") or []
    reply = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
    calls = [f"{(c.get('function') or {}).get('name')}({(c.get('function') or {}).get('arguments')})"
             for c in reply.get("tool_calls") or [] if isinstance(c, dict)]
    return "\n".join(p for p in [text_of(reply.get("content")), *calls] if p)


class Unreachable(Exception):
    """No vote got an answer at all: the judge is down, so the turn waits and is judged later."""


Ask = Callable[[JudgeCall], Awaitable[str]]


class Judges:
    """Judges linked turns in the background, per scenario, and stores each judgment as a report."""

    def __init__(self, registry: Registry, store: RecordStore) -> None:
        self.registry, self.store = registry, store
        self._queues: dict[str, asyncio.Queue[str]] = {}
        self._workers: dict[str, list[asyncio.Task[None]]] = {}
        self._queued: dict[str, set[str]] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._engines: dict[str, Engine] = {}  # judge engines of their own (a `model:` config), by its key
        self.stats: dict[str, Counter[str]] = {}
        self._closed = False

    @staticmethod
    def settings(scenario: Scenario | None) -> JudgeSettings | None:
        return scenario.recipe.judge if scenario is not None and isinstance(scenario.recipe, Judged) else None

    def status(self, scenario: str) -> dict[str, Any]:
        stats = self.stats.get(scenario, Counter())
        return {"pending": len(self._queued.get(scenario, ())), **{k: stats[k] for k in
                ("judged", "unreachable", "invalid_votes", "positive", "negative", "neutral", "hinted")}}

    # ---------------------------------------------------------------- queue

    def linked(self, scenario: str, receipt: str) -> None:
        """A turn got its next state: judge it (if the scenario's recipe has a judge)."""
        settings = self.settings(self.registry.scenarios.get(scenario))
        if settings is None or self._closed:
            return
        queued = self._queued.setdefault(scenario, set())
        if receipt in queued:
            return
        queued.add(receipt)
        self._queue(scenario, settings).put_nowait(receipt)

    def _queue(self, scenario: str, settings: JudgeSettings) -> asyncio.Queue[str]:
        queue = self._queues.get(scenario)
        if queue is None:
            queue = self._queues[scenario] = asyncio.Queue()
            self._workers[scenario] = [asyncio.create_task(self._work(scenario, queue), name=f"judge-{scenario}")
                                       for _ in range(max(1, settings.concurrency))]
        return queue

    async def backlog(self) -> None:
        """At start: turns that got a next state but no judgment before reefd stopped are judged now."""
        for name, scenario in list(self.registry.scenarios.items()):
            if self.settings(scenario) is None:
                continue
            records = await asyncio.to_thread(self.store.unconsumed, name)
            for record in records:
                if record.get("next_state") is not None and not any(
                        r.get("source") == "judge" for r in record.get("reports") or []):
                    self.linked(name, record["id"])

    async def close(self) -> None:
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        tasks = [t for ts in self._workers.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a worker ends only when cancelled
        for engine in self._engines.values():
            await engine.stop()

    async def _work(self, scenario: str, queue: asyncio.Queue[str]) -> None:
        while True:
            receipt = await queue.get()
            try:
                await self.judge(scenario, receipt)
                self._queued.get(scenario, set()).discard(receipt)
            except Unreachable as exc:
                self.stats.setdefault(scenario, Counter())["unreachable"] += 1
                settings = self.settings(self.registry.scenarios.get(scenario))
                delay = settings.retry_s if settings is not None else 30.0
                log.warning("%s: judge unreachable for %s (%s); again in %.0f s", scenario, receipt, exc, delay)
                self._later(delay, queue, receipt)
            except UnknownReceipt:  # retention deleted the record meanwhile: nothing left to judge
                log.info("%s: %s was deleted before its judgment was stored", scenario, receipt)
                self._queued.get(scenario, set()).discard(receipt)
            except StorageError as exc:
                log.warning("%s: judgment of %s not stored: %s", scenario, receipt, exc)
                self._later(30.0, queue, receipt)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the judge of every later turn
                log.exception("%s: judging %s failed", scenario, receipt)
                self._queued.get(scenario, set()).discard(receipt)

    def _later(self, delay: float, queue: asyncio.Queue[str], receipt: str) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def put() -> None:
            assert handle is not None
            self._timers.discard(handle)
            queue.put_nowait(receipt)

        handle = loop.call_later(delay, put)
        self._timers.add(handle)

    # ---------------------------------------------------------------- one judgment

    async def judge(self, scenario_name: str, receipt: str) -> dict[str, Any] | None:
        """Judge one linked turn and store the judgment; returns the report (None: nothing to judge)."""
        scenario = self.registry.scenarios.get(scenario_name)
        settings = self.settings(scenario)
        if scenario is None or settings is None:
            return None
        record = await asyncio.to_thread(self.store.get_record, receipt)
        if record is None or record.get("next_state") is None:
            return None
        if any(r.get("source") == "judge" for r in record.get("reports") or []):
            return None
        started = time.monotonic()
        ask = await self._asker(scenario, settings)
        response, state = reply_text(record), list(record.get("next_state") or [])

        async def vote(kind: str, i: int) -> str | None:
            call = JudgeCall(kind, i, prompt(kind, response, state), response, state, record)
            try:
                return await asyncio.wait_for(ask(call), settings.timeout_s)
            except (EngineUnavailable, ConnectionError):
                raise
            except Exception as exc:  # a failed or timed-out call is an invalid vote
                log.info("%s: judge vote failed: %r", scenario_name, exc)
                return None

        kinds = ["verdict"] * settings.votes + (["hint"] * settings.votes if settings.hints else [])
        results = await asyncio.gather(*(vote(k, i % settings.votes) for i, k in enumerate(kinds)),
                                       return_exceptions=True)
        if all(isinstance(r, BaseException) for r in results):
            raise Unreachable(str(results[0]))
        answers = [None if isinstance(r, BaseException) else r for r in results]
        verdict_answers, hint_answers = answers[:settings.votes], answers[settings.votes:]
        votes = [parse_vote(a) for a in verdict_answers]
        verdict = plurality(votes)
        hints = select_hints(hint_answers, settings.max_hints) if settings.hints else []
        stats = self.stats.setdefault(scenario_name, Counter())
        stats["judged"] += 1
        stats["invalid_votes"] += sum(v is None for v in votes)
        stats[{1: "positive", -1: "negative", 0: "neutral"}[verdict]] += 1
        stats["hinted"] += bool(hints)
        body = {"references": [receipt], "score": float(verdict), "report_id": f"judge-{receipt}",
                "feedback": hints[0] if hints else None,
                "metadata": {"verdict": verdict, "votes": votes, "hints": hints,
                             "hint_votes": [parse_vote(a, (1, -1)) for a in hint_answers],
                             "judge": describe(settings), "seconds": round(time.monotonic() - started, 3),
                             "answers": [(a or "")[:2000] for a in answers]}}
        stored, _ = await self.store.put_report(scenario_name, body, source="judge")
        return stored

    async def _asker(self, scenario: Scenario, settings: JudgeSettings) -> Ask:
        model = settings.model
        if isinstance(model, str):
            fn = plugins.resolve({}, model, "judge")

            async def call_fn(call: JudgeCall) -> str:
                answer = fn(call)
                if inspect.isawaitable(answer):
                    answer = await answer
                return answer if isinstance(answer, str) else ""

            return call_fn
        engine = scenario.engine if model is None else await self._engine(ModelConfig(**model))
        if not engine.ready:
            raise Unreachable(f"the judge engine is {engine.describe().get('state')}")

        async def call_engine(call: JudgeCall) -> str:
            req = ChatRequest(messages=call.messages, max_tokens=settings.max_tokens,
                              temperature=settings.temperature, top_p=settings.top_p)
            async for event in engine.generate(req, stream=False, timeout_s=settings.timeout_s):
                if isinstance(event, Completion):
                    return event.text or ""
            raise EngineError("the judge engine ended without an answer")

        return call_engine

    async def _engine(self, cfg: ModelConfig) -> Engine:
        """A judge model of its own: a scenario's engine when one serves that model, else one started once and
        kept until reefd stops."""
        for scenario in self.registry.scenarios.values():
            if asdict(scenario.cfg.model) == asdict(cfg):
                return scenario.engine
        key = repr(sorted(asdict(cfg).items()))
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = build_engine(cfg, self.registry.state_dir, self.registry.session)
            await engine.start()
        return engine


def describe(settings: JudgeSettings) -> str:
    """Which judge judged: the scenario's engine, a model's name, or a function's path."""
    model = settings.model
    if model is None:
        return "scenario engine (base model)"
    if isinstance(model, str):
        return f"function {model}"
    return f"model {model.get('name') or model.get('source') or model.get('url') or model.get('path')}"


__all__ = ["JudgeCall", "JudgeSettings", "Judges", "parse_hint", "parse_vote", "plurality", "select_hints"]
