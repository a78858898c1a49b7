"""The plug points by name: each has a registry of YAML names plus `pkg.mod:Name` for users' own (an engine, a
gate kind, a trainer backend; recipes have tests/test_recipes.py), checked against its Protocol when loaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest

from reefd import config, plugins
from reefd.commit import gates
from reefd.commit.gates import Generate, KnownScores, Sampling, Verdict
from reefd.engines import ModelConfig, build_engine, engine_class
from reefd.grow.backends import Backends
from reefd.grow.backends.local import LocalTrainers
from reefd.serve.chat import ChatRequest, Completion
from tests.conftest import make_scenarios


class EchoEngine:
    """An engine of a user's own: it answers with the last message's text."""

    kind = "echo"

    def __init__(self, cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.adapters: dict[str, Path] = {}
        self.ready = False

    async def start(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False

    async def generate(self, req: ChatRequest, *, stream: bool = True, timeout_s: float = 600.0,
                       adapter: str | None = None) -> AsyncIterator[str | Completion]:
        text = str(req.messages[-1]["content"])
        yield text
        yield Completion(text=text, finish_reason="stop", prompt_tokens=0, completion_tokens=len(text.split()),
                         raw_text=text)

    async def load_adapter(self, name: str, path: Path) -> None:
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name)

    def count_tokens(self, req: ChatRequest) -> int:
        return len(str(req.messages[-1]["content"]).split())

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": "ready" if self.ready else "stopped"}

    def model_folder(self) -> Path | None:
        return None


class NotAnEngine:
    def __init__(self, *args: Any) -> None: ...


@dataclass
class LengthConfig:
    at_least: int = field(default=1, metadata={"minimum": 0})


class LengthGate:
    """A gate kind of a user's own: the candidate's answer to "ping" must be at least `at_least` characters."""

    kind: ClassVar[str] = "length"
    Config: ClassVar[type] = LengthConfig

    def __init__(self, cfg: LengthConfig, scenarios_dir: Path) -> None:
        self.cfg = cfg
        self.sampling: Sampling | None = Sampling(max_tokens=8, temperature=0.0)
        self.reuse_current = False

    def check(self) -> str | None:
        return None

    async def evaluate(self, generate: Generate, *, current: str | None, candidate: str | None,
                       concurrency: int = 4, context: dict[str, Any] | None = None,
                       known_current: KnownScores | None = None) -> Verdict:
        assert self.sampling is not None
        text = await generate([{"role": "user", "content": "ping"}], candidate, self.sampling, 0)
        passed = len(text) >= self.cfg.at_least
        return Verdict(passed, self.kind, float(passed), None, 1, 0.0, None, f"{len(text)} characters", [])


@dataclass
class InlineConfig:
    """Its keys under `recipe.backend`, besides kind."""

    note: str = ""


class InlineBackend:
    """A trainer backend of a user's own (it fails every job)."""

    Config = InlineConfig
    detachable = full_weights = pushes = False

    def __init__(self, work_dir: Path, max_jobs: int, cfg: InlineConfig) -> None:
        self.work_dir, self.max_jobs, self.cfg = work_dir, max_jobs, cfg
        self.warmed = 0

    async def run(self, spec: Path, on_event: Callable[[dict[str, Any]], None], timeout_s: float) -> int:
        on_event({"event": "error", "reason": "inline backends train nothing"})
        return 1

    async def close(self) -> None:
        return None

    def prewarm(self) -> None:
        self.warmed += 1


def compose(tmp_path: Path, body: str) -> config.ScenarioConfig:
    scen = make_scenarios(tmp_path, names=(), extra={"x": "defaults:\n  - model: tiny\n  - _self_\n" + body})
    return config.compose(scen / "x.yaml")


def test_an_engine_of_your_own_by_dotted_path(tmp_path: Path) -> None:
    cfg = compose(tmp_path, "model:\n  engine: tests.test_plugins:EchoEngine\n  source: null\n")
    assert cfg.model.engine == "tests.test_plugins:EchoEngine"

    async def main() -> list[Any]:
        async with aiohttp.ClientSession() as session:
            engine = build_engine(cfg.model, tmp_path, session)
            await engine.start()
            req = ChatRequest(messages=[{"role": "user", "content": "hello there"}], max_tokens=4)
            return [e async for e in engine.generate(req)]

    events = asyncio.run(main())
    assert events[0] == "hello there" and isinstance(events[-1], Completion)
    with pytest.raises(plugins.PluginError, match=r"is not an Engine \(no .*generate"):
        engine_class("tests.test_plugins:NotAnEngine")
    with pytest.raises(config.ConfigError, match=r"model\.engine: engine 'nope\.mod:X' cannot be imported"):
        compose(tmp_path / "bad", "model:\n  engine: nope.mod:X\n")


def test_a_gate_kind_of_your_own_by_dotted_path(tmp_path: Path) -> None:
    cfg = compose(tmp_path, "gate:\n  kind: tests.test_plugins:LengthGate\n  at_least: 3\n")
    gate = gates.build(cfg.gate, tmp_path)
    assert isinstance(gate, LengthGate) and gate.cfg.at_least == 3

    async def answer(messages: list[dict[str, Any]], side: str | None, sampling: Sampling, seed: int) -> str:
        return "pong" if side == "good" else "p"

    assert asyncio.run(gate.evaluate(answer, current=None, candidate="good")).passed
    assert not asyncio.run(gate.evaluate(answer, current=None, candidate="bad")).passed
    with pytest.raises(config.ConfigError, match=r"gate\.at_least: -1 is less than the minimum of 0"):
        compose(tmp_path / "bad", "gate:\n  kind: tests.test_plugins:LengthGate\n  at_least: -1\n")
    with pytest.raises(gates.GateError, match=r"is not a Gate \(no check, evaluate, kind\)"):
        gates.build({"kind": "tests.test_plugins:InlineBackend"}, tmp_path)


def test_a_trainer_backend_of_your_own_by_dotted_path(tmp_path: Path) -> None:
    cfg = compose(tmp_path, "recipe:\n  name: sao\n  backend: tests.test_plugins:InlineBackend\n")
    backends = Backends(tmp_path / "jobs", max_jobs=2)
    mine = backends.get(cfg.recipe.backend)
    assert isinstance(mine, InlineBackend) and mine.max_jobs == 2 and backends.get(cfg.recipe.backend) is mine
    assert mine.work_dir == tmp_path / "jobs" / "backends" / "tests.test_plugins:InlineBackend"
    backends.prewarm([cfg.recipe.backend, cfg.recipe.backend])
    assert mine.warmed == 1
    assert isinstance(backends.get("local"), LocalTrainers)
    with pytest.raises(plugins.PluginError, match=r"is not a TrainerBackend"):
        backends.get("tests.test_plugins:EchoEngine")
    with pytest.raises(config.ConfigError, match=r"recipe\.backend: unknown trainer backend 'nope': use one of local"):
        compose(tmp_path / "bad", "recipe:\n  backend: nope\n")
    keyed = compose(tmp_path / "keyed", "recipe:\n  backend: {kind: tests.test_plugins:InlineBackend, note: hi}\n")
    assert backends.get(keyed.recipe.backend).cfg.note == "hi"  # type: ignore[attr-defined]
    with pytest.raises(config.ConfigError, match=r"recipe\.backend: Additional properties are not allowed"):
        compose(tmp_path / "typo", "recipe:\n  backend: {kind: tests.test_plugins:InlineBackend, nope: 1}\n")
