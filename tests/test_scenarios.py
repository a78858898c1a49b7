"""The scenario registry across reloads: an engine no scenario uses any more is stopped once its requests have
finished, or when reefd stops; a reload that brings its model back before then takes the same engine back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from reefd import config
from reefd.config import ScenarioConfig
from reefd.serve.scenarios import Binding, Registry, Scenario
from tests.conftest import make_scenarios
from tests.test_plugins import EchoEngine


class Tracked(EchoEngine):
    """An engine that notes every stop."""

    stopped: ClassVar[list[str]] = []

    async def stop(self) -> None:
        await super().stop()
        Tracked.stopped.append(self.cfg.name)


def configs(tmp_path: Path, model: str) -> dict[str, ScenarioConfig]:
    body = f"model:\n  name: {model}\n  engine: tests.test_scenarios:Tracked\n  source: null\n"
    scen = make_scenarios(tmp_path / model, names=(), extra={"s": "defaults:\n  - model: tiny\n  - _self_\n" + body})
    return config.load_all(scen)


async def bind(scenario: Scenario) -> None:
    scenario.binding = Binding("r0-0000000")


def test_a_dropped_engine_stops_once_drained_or_is_taken_back(tmp_path: Path) -> None:
    a, b = configs(tmp_path, "a"), configs(tmp_path, "b")

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as session:
            registry = Registry(a, tmp_path, session)
            await registry.start()
            first = registry.get("s")
            first.binding = Binding("r0-0000000")
            async with registry.serving(first):  # a request in flight on engine a
                await registry.reload(b, bind)
                out["moved"] = registry.get("s").engine is not first.engine and Tracked.stopped == []
                await registry.reload(a, bind)  # a comes back while its request still runs
                out["taken back"] = registry.get("s").engine is first.engine
            await asyncio.sleep(0.5)
            out["after drain"] = list(Tracked.stopped)  # b, unused and idle, stopped; a serves again
            async with registry.serving(registry.get("s")):
                await registry.reload(b, bind)  # a is dropped again, with a request in flight
                await registry.stop()  # reefd stops before a drained: a is stopped all the same
            out["at stop"] = sorted(Tracked.stopped)
        return out

    Tracked.stopped.clear()
    out = asyncio.run(main())
    assert out == {"moved": True, "taken back": True, "after drain": ["b"], "at stop": ["a", "b", "b"]}
