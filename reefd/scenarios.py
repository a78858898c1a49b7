"""The scenario registry: composed configs bound to running engines, and request routing.

A request names its scenario with `x-reef-scenario: NAME` or the path form
`/scenarios/NAME/v1/...`. Scenarios whose models are identical share one engine.
Knows nothing about wire formats or records.
"""

from __future__ import annotations

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


class Registry:
    def __init__(self, configs: dict[str, ScenarioConfig], state_dir: Path,
                 session: aiohttp.ClientSession):
        self.engines: dict[str, Engine] = {}
        self.scenarios: dict[str, Scenario] = {}
        for name, cfg in sorted(configs.items()):
            key = json.dumps(to_dict(cfg)["model"], sort_keys=True)
            if key not in self.engines:
                self.engines[key] = build_engine(cfg.model, state_dir, session)
            self.scenarios[name] = Scenario(cfg, self.engines[key])

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()

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
