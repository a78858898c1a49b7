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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from reefd.api.errors import ApiError
from reefd.config import ScenarioConfig, to_dict
from reefd.engines import Engine, build_engine
from reefd.reconcile import Binding, Reconciler
from reefd.releases import ReleaseChain

log = logging.getLogger("reefd")

SCENARIO_HEADER = "x-reef-scenario"


@dataclass
class Scenario:
    cfg: ScenarioConfig
    engine: Engine
    binding: Binding | None = None  # what serves new requests, once the reconciler has bound a release
    error: str | None = None  # why the reconciler could not make it serve what is declared

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def release(self) -> str | None:
        """The id of the release serving new requests."""
        return self.binding.release if self.binding else None


def _model_key(cfg: ScenarioConfig) -> str:
    return json.dumps(to_dict(cfg)["model"], sort_keys=True)


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)


class Registry:
    def __init__(self, configs: dict[str, ScenarioConfig], state_dir: Path,
                 session: aiohttp.ClientSession, chain: ReleaseChain, scenarios_dir: Path = Path("scenarios")):
        self.state_dir = state_dir
        self.chain = chain
        self.session = session
        self.engines: dict[str, Engine] = {}
        self.scenarios: dict[str, Scenario] = {}
        self.scenarios, _ = self._bind(configs)
        self._inflight: Counter[int] = Counter()  # requests per engine (by id), for draining
        self._uses: Counter[tuple[int, str | None]] = Counter()  # requests per (engine, adapter)
        self._reloading = asyncio.Lock()
        self.reconciler = Reconciler(self, chain, state_dir, scenarios_dir)

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
            same_engine = old is not None and old.engine is self.engines[key]
            scenarios[name] = Scenario(cfg, self.engines[key], old.binding if old and same_engine else None,
                                       old.error if old and same_engine else None)
        return scenarios, fresh

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()
        self.reconciler.start()

    @contextlib.contextmanager
    def serving(self, scenario: Scenario) -> Iterator[Binding]:
        """Take the scenario's current binding for one request and count the request in flight on it,
        so neither a reload nor a release swap takes its engine or adapter away mid-answer."""
        binding = scenario.binding
        if binding is None:  # the chain has not named this scenario's release yet
            why = f": {scenario.error}" if scenario.error else "; retry shortly"
            raise ApiError(503, f"scenario {scenario.name!r} is not serving yet{why}",
                           code="engine_unavailable", headers={"Retry-After": "2"})
        use = (id(scenario.engine), binding.adapter)
        self._inflight[use[0]] += 1
        self._uses[use] += 1
        try:
            yield binding
        finally:
            self._inflight[use[0]] -= 1
            self._uses[use] -= 1

    @contextlib.contextmanager
    def using(self, engine: Engine, adapter: str | None) -> Iterator[None]:
        """Keep `adapter` loaded on `engine` while a non-request user (a gate) generates with it."""
        self._uses[(id(engine), adapter)] += 1
        try:
            yield
        finally:
            self._uses[(id(engine), adapter)] -= 1

    def in_flight(self, engine: Engine, adapter: str | None) -> int:
        """Requests running on `engine` with `adapter`."""
        return self._uses[(id(engine), adapter)]

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
                if old is None or old.engine is scenario.engine:
                    continue
                if scenario.engine.ready:  # bind its release on the new engine before the route moves
                    await self.reconciler.reconcile(scenario, pending=True)
                if not scenario.engine.ready or (scenario.binding is None and old.binding is not None):
                    log.error("reload: scenario %s keeps its previous model; the new one is %s%s",
                              name, scenario.engine.describe()["state"],
                              f" ({scenario.error})" if scenario.error else "")
                    scenarios[name] = old
            for name, scenario in scenarios.items():  # swaps made while this reload waited still hold
                old = self.scenarios.get(name)
                if old is not None and old is not scenario and old.engine is scenario.engine:
                    scenario.binding, scenario.error = old.binding, old.error
            self.scenarios = scenarios
            for name in scenarios:  # a changed pin, a new scenario: reconcile against the new files
                self.reconciler.kick(name)
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
        await self.reconciler.stop()
        for engine in self.engines.values():
            await engine.stop()

    @property
    def ready(self) -> bool:
        return all(s.engine.ready and s.binding for s in self.scenarios.values())

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
