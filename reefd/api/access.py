"""Which scenarios the request's token covers: every handler reaches a scenario through here.

A scenario named in the path, the header or the query that the token does not cover is a 403. A record, release,
response or job of such a scenario is "not found", as if it did not exist, so its id tells nothing.
Lists (status, models, jobs) show only the covered scenarios.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from reefd.api.errors import SCENARIO_HEADER, ApiError, shown
from reefd.loop import REGISTRY
from reefd.ops.auth import GRANT
from reefd.ops.tokens import FULL, Grant
from reefd.serve.scenarios import Scenario, UnknownScenario


def grant(request: web.Request) -> Grant:
    return request.get(GRANT, FULL)  # no auth middleware (the metrics-only site): everything


def require(request: web.Request, name: str, *, param: str | None = SCENARIO_HEADER) -> None:
    g = grant(request)
    if not g.covers(name):
        raise ApiError(403, f"{g.describe()} may not use scenario {shown(name)}", param=param, code="permission_denied")


def scenario(request: web.Request, name: str, *, param: str | None = SCENARIO_HEADER) -> Scenario:
    """The served scenario `name`, if the token covers it (an unknown name lists only the covered ones)."""
    require(request, name, param=param)
    registry = request.app[REGISTRY]
    try:
        return registry.get(name)
    except UnknownScenario as exc:
        raise UnknownScenario(exc.name, visible(request, exc.known)) from None


def visible(request: web.Request, names: Iterable[str]) -> list[str]:
    return grant(request).visible(names)


def covers(request: web.Request, name: str) -> bool:
    return grant(request).covers(name)


def require_everything(request: web.Request, what: str) -> None:
    """For what spans every scenario (metrics): a token limited to some scenarios gets 403."""
    g = grant(request)
    if g.scenarios is not None:
        raise ApiError(403, f"{what} covers every scenario; {g.describe()} is limited to some",
                       code="permission_denied")
