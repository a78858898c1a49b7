"""The scenario registry: composed configs bound to running engines, and request routing.

A request names its scenario with `x-reef-scenario: NAME` or the path form
`/scenarios/NAME/v1/...`. Scenarios whose models are identical share one engine.
Knows nothing about wire formats or records.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from reefd.api.errors import ApiError
from reefd.config import ScenarioConfig, to_dict
from reefd.engines import Engine, build_engine

log = logging.getLogger("reefd")

SCENARIO_HEADER = "x-reef-scenario"
BASE_RELEASE = "base"  # the untouched base model; the release chain names later releases


@dataclass
class Scenario:
    cfg: ScenarioConfig
    engine: Engine
    release: str = BASE_RELEASE

    @property
    def name(self) -> str:
        return self.cfg.name


def _model_key(cfg: ScenarioConfig) -> str:
    return json.dumps(to_dict(cfg)["model"], sort_keys=True)


class Registry:
    def __init__(self, configs: dict[str, ScenarioConfig], state_dir: Path,
                 session: aiohttp.ClientSession):
        self.state_dir = state_dir
        self.session = session
        self.engines: dict[str, Engine] = {}
        self.scenarios: dict[str, Scenario] = {}
        self._next: dict[str, Scenario] = {}
        self._bind(configs)

    def _bind(self, configs: dict[str, ScenarioConfig]) -> list[Engine]:
        """Point scenarios at engines, building engines for new models; returns the new ones."""
        new: list[Engine] = []
        scenarios = {}
        for name, cfg in sorted(configs.items()):
            key = _model_key(cfg)
            if key not in self.engines:
                self.engines[key] = build_engine(cfg.model, self.state_dir, self.session)
                new.append(self.engines[key])
            old = self.scenarios.get(name)
            scenarios[name] = Scenario(cfg, self.engines[key],
                                       old.release if old else BASE_RELEASE)
        self._next = scenarios
        return new

    async def start(self) -> None:
        self.scenarios = self._next
        for engine in self.engines.values():
            await engine.start()

    async def reload(self, configs: dict[str, ScenarioConfig]) -> None:
        """Apply a re-read scenario folder without dropping requests.

        New engines start and get until their start-up deadline to generate before any route
        moves to them; requests in flight keep the Scenario (and engine) they resolved; an
        engine that no scenario uses any more is stopped after the swap.
        """
        fresh = self._bind(configs)
        for engine in fresh:
            await engine.start()
        deadline = max((s.cfg.model.startup_timeout_s for s in self._next.values()), default=0)
        waited = 0.0
        while any(not e.ready and e.describe()["state"] != "failed" for e in fresh) \
                and waited < deadline:
            await asyncio.sleep(0.25)
            waited += 0.25
        self.scenarios = self._next
        used = {_model_key(s.cfg) for s in self.scenarios.values()}
        for key in [k for k in self.engines if k not in used]:
            await self.engines.pop(key).stop()

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()

    @property
    def ready(self) -> bool:
        return all(engine.ready for engine in self.engines.values())

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
