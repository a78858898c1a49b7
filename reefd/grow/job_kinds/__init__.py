"""Job kinds, one per product (weights, harness, search), each making and judging its candidate while the runner
(reefd/grow/runner.py) walks the stages and commits: here, their contract and the engine calls they share. Knows
nothing about when jobs run or how a release is written."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reefd.commit import gates
from reefd.commit.chain import ReleaseChain
from reefd.commit.gates.memory import ScoreMemory
from reefd.engines import Engine
from reefd.grow.backends import Backends
from reefd.grow.job_store import Job, JobStore
from reefd.harness import Harness
from reefd.serve.chat import ChatRequest, Completion, add_system_text
from reefd.serve.scenarios import Registry, Scenario

PROPOSAL_CHARS = 64 << 10  # a proposer's answer beyond this is cut in the release


class JobFailed(Exception):
    """The job cannot go on; str() is the one-line reason recorded on it."""


@dataclass
class Made:
    """A candidate not judged yet: what the chain keeps (`kind`: adapter, weights, harness, bundle) and what its gate
    needs."""

    kind: str
    meta: dict[str, Any]
    artifact: Path
    harnesses: tuple[Harness, Harness] | None = None  # (serving, proposed)
    pushed: Engine | None = None


class JobContext(Protocol):
    """What a job kind uses of the runner that holds it (reefd/grow/runner.py's Runner, which the kinds never
    import): the scenarios and the engines they borrow, the job store (work folders), the chain, the trainer
    backends, remembered gate scores, the scenarios folder (task files), and `save`: the job saved, at `stage` when
    given (where a cancel that a stage swallowed is honoured)."""

    registry: Registry
    jobs: JobStore
    chain: ReleaseChain
    backends: Backends
    scores: ScoreMemory
    scenarios_dir: Path

    async def save(self, job: Job, stage: str | None = None) -> None: ...


class JobKind(Protocol):
    """How one product's candidate is made from the recipe's spec (None: skipped, the job says why; engines it
    borrows until its gate live on `stack`), judged against serving by a `gate` that generates, and taken up
    again after a restart (`resumed`)."""

    async def make(self, job: Job, scenario: Scenario, spec: Any, stack: contextlib.AsyncExitStack) -> Made | None: ...

    async def gate(self, job: Job, scenario: Scenario, made: Made, gate: gates.Gate) -> gates.Verdict: ...

    def resumed(self, scenario: Scenario, made: Made) -> Made:
        """A candidate saved before a restart (kind, meta and folder only), with what its gate needs again."""
        ...


def recipe_params(scenario: Scenario) -> dict[str, Any]:
    """What a release keeps of the job that made it (its `params`): the recipe and its settings as declared."""
    return {"recipe": scenario.cfg.recipe.name,
            "recipe_params": json.loads(json.dumps(scenario.cfg.recipe.params, default=str))}


def clipped(text: str) -> str:
    """A proposer's answer as a release keeps it: at most PROPOSAL_CHARS characters."""
    if len(text) <= PROPOSAL_CHARS:
        return text
    return f"{text[:PROPOSAL_CHARS]}\n[... {len(text) - PROPOSAL_CHARS} more characters]"


async def until_ready(engine: Engine, startup_s: float, what: str, detail: bool = False) -> None:
    """Wait for an engine a job borrows (JobFailed once it failed or `startup_s` passed); `detail` adds its
    last error to the message."""
    deadline = time.monotonic() + startup_s
    while not engine.ready:
        state = engine.describe()
        if state["state"] == "failed" or time.monotonic() > deadline:
            raise JobFailed(f"the {what} engine is {state['state']}"
                            + (f": {state.get('last_error')}" if detail else ""))
        await asyncio.sleep(0.25)


async def answer(scenario: Scenario, engine: Engine, adapter: str | None, messages: list[dict[str, Any]],
                 max_tokens: int, temperature: float, seed: int | None = None, system: str | None = None) -> str:
    """The text of one non-streamed answer from `engine` and `adapter` (`system` added to its system prompt)."""
    req = ChatRequest(messages=messages, max_tokens=max_tokens, temperature=temperature, seed=seed)
    if system is not None:
        add_system_text(req, system)
    async for event in engine.generate(req, stream=False, adapter=adapter,
                                       timeout_s=scenario.cfg.serve.request_timeout_s):
        if isinstance(event, Completion):
            return event.text or ""
    raise JobFailed("the engine ended without an answer")


async def no_generate(messages: list[dict[str, Any]], adapter: str | None, sampling: gates.Sampling, seed: int) -> str:
    raise JobFailed("the always gate generates nothing")
