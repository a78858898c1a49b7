"""The scenario registry: composed configs bound to running engines, and request routing.

A request names its scenario with `x-reef-scenario: NAME` or the path form
`/scenarios/NAME/v1/...`. Scenarios whose models are identical share one engine.
Knows nothing about wire formats or records.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from reefd.api.errors import ApiError
from reefd.config import ScenarioConfig, to_dict
from reefd.engines import Engine, build_engine
from reefd.identity import model_identity
from reefd.releases import HeadConflict, ReleaseChain

log = logging.getLogger("reefd")

SCENARIO_HEADER = "x-reef-scenario"


@dataclass
class Scenario:
    cfg: ScenarioConfig
    engine: Engine
    release: str | None = None  # the serving release's id, once the chain has one

    @property
    def name(self) -> str:
        return self.cfg.name


def _model_key(cfg: ScenarioConfig) -> str:
    return json.dumps(to_dict(cfg)["model"], sort_keys=True)


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)


class Registry:
    def __init__(self, configs: dict[str, ScenarioConfig], state_dir: Path,
                 session: aiohttp.ClientSession, chain: ReleaseChain):
        self.state_dir = state_dir
        self.chain = chain
        self._tasks: set[asyncio.Task[None]] = set()
        self.session = session
        self.engines: dict[str, Engine] = {}
        self.scenarios: dict[str, Scenario] = {}
        self.scenarios, _ = self._bind(configs)
        self._inflight: Counter[int] = Counter()  # requests per engine (by id), for draining
        self._reloading = asyncio.Lock()

    def _bind(self, configs: dict[str, ScenarioConfig]) -> tuple[dict[str, Scenario], list[str]]:
        """Scenarios bound to engines (building engines for new models), and the new engines' keys."""
        fresh: list[str] = []
        scenarios = {}
        for name, cfg in sorted(configs.items()):
            key = _model_key(cfg)
            if key not in self.engines:
                self.engines[key] = build_engine(cfg.model, self.state_dir, self.session)
                fresh.append(key)
            old = self.scenarios.get(name)
            scenarios[name] = Scenario(cfg, self.engines[key], old.release if old else None)
        return scenarios, fresh

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()
        self._bind_releases(self.scenarios.values())

    def _bind_releases(self, scenarios: Iterable[Scenario]) -> None:
        for scenario in scenarios:
            if scenario.release is None:
                task = asyncio.create_task(self._bind_release(scenario))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _bind_release(self, scenario: Scenario) -> None:
        """Serve the chain's head; a scenario's first start records its base release."""
        head = await asyncio.to_thread(self.chain.head, scenario.name)
        if head is None:
            while (model_dir := scenario.engine.model_folder()) is None and \
                    scenario.cfg.model.engine != "upstream":
                await asyncio.sleep(0.25)  # a built-in model is still being prepared
            ident = await asyncio.to_thread(model_identity, scenario.cfg.model, model_dir)
            try:
                head = await asyncio.to_thread(
                    self.chain.publish, scenario.name, expected_head=None, kind="base",
                    artifact_dir=None, meta={"source": "import", "identity": ident})
                log.info("%s: recorded base release %s", scenario.name, head.id)
            except HeadConflict:  # another process recorded it first: serve that
                head = await asyncio.to_thread(self.chain.head, scenario.name)
        assert head is not None
        scenario.release = head.id

    @contextlib.contextmanager
    def serving(self, scenario: Scenario) -> Iterator[None]:
        """Count a request in flight on its engine, so a reload never stops it mid-answer."""
        self._inflight[id(scenario.engine)] += 1
        try:
            yield
        finally:
            self._inflight[id(scenario.engine)] -= 1

    async def reload(self, configs: dict[str, ScenarioConfig]) -> None:
        """Apply a re-read scenario folder without dropping requests.

        New engines start and get until their start-up deadline to generate before any route
        moves to them; a scenario whose new engine fails keeps its old binding. Requests in
        flight keep the engine they resolved, and an engine no scenario uses any more is
        stopped only once its requests have finished.
        """
        async with self._reloading:
            scenarios, fresh = self._bind(configs)
            for key in fresh:
                await self.engines[key].start()
            deadline = max((s.cfg.model.startup_timeout_s for s in scenarios.values()), default=0)
            await _until(lambda: all(self.engines[k].ready or
                                     self.engines[k].describe()["state"] == "failed"
                                     for k in fresh), deadline)
            for name, scenario in scenarios.items():
                old = self.scenarios.get(name)
                if old is not None and not scenario.engine.ready and old.engine.ready:
                    log.error("reload: scenario %s keeps its previous model; the new one is %s",
                              name, scenario.engine.describe()["state"])
                    scenarios[name] = old
            self.scenarios = scenarios
            self._bind_releases(scenarios.values())
            used = {id(s.engine) for s in scenarios.values()}
            for key, engine in list(self.engines.items()):
                if id(engine) not in used:
                    del self.engines[key]
                    drain = max((s.cfg.serve.request_timeout_s for s in scenarios.values()),
                                default=600.0)
                    await _until(functools.partial(self._idle, engine), drain)
                    await engine.stop()

    def _idle(self, engine: Engine) -> bool:
        return self._inflight[id(engine)] == 0

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for engine in self.engines.values():
            await engine.stop()

    @property
    def ready(self) -> bool:
        return all(s.engine.ready and s.release for s in self.scenarios.values())

    def get(self, name: str) -> Scenario:
        try:
            return self.scenarios[name]
        except KeyError:
            known = ", ".join(sorted(self.scenarios)) or "(none)"
            raise ApiError(404, f"unknown scenario {name!r}; known scenarios: {known}",
                           param=SCENARIO_HEADER, code="scenario_not_found") from None

    def resolve(self, request: web.Request) -> Scenario:
        name = request.match_info.get("scenario") or request.headers.get(SCENARIO_HEADER)
        if not name:
            raise ApiError(400, f"missing the {SCENARIO_HEADER} header: it names the scenario "
                           f"that serves this request (known: {', '.join(sorted(self.scenarios))})",
                           param=SCENARIO_HEADER, code="scenario_missing")
        return self.get(name.strip())
