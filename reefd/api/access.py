"""Which scenarios the request's token covers, and whose requests it makes: every handler reaches a scenario
and a user through here.

A scenario named in the path, the header or the query that the token does not cover is a 403. A record, release,
response or job of such a scenario is "not found", as if it did not exist, so its id tells nothing.
Lists (status, models, jobs) show only the covered scenarios. A token created for a user makes that user's
requests and sees that user's records only; a root or scenario token names a user with x-reef-user. A session
belongs to whoever opened it (`owner`: the token, and the user).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from reefd.api.errors import SCENARIO_HEADER, ApiError, shown
from reefd.loop import REGISTRY
from reefd.ops.auth import GRANT
from reefd.ops.tokens import FULL, Grant, user_problem
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


USER_HEADER = "x-reef-user"


def user(request: web.Request, scenario: Scenario) -> str | None:
    """The user a request to `scenario` is made for: its token's, else x-reef-user's (None: nobody's). 400 for a
    name that cannot be one, or a user on a scenario that does not learn per user; 403 for a user's token that
    names another."""
    g = grant(request)
    named = request.headers.get(USER_HEADER)
    if g.user is not None and named is not None and named != g.user:
        raise ApiError(403, f"{g.describe()} speaks for its own user only, not {shown(named)}", param=USER_HEADER,
                       code="permission_denied")
    name = g.user if g.user is not None else named
    if name is None:
        return None
    if (problem := user_problem(name)) is not None:
        raise ApiError(400, f"{USER_HEADER}: the user name {shown(name)} {problem}", param=USER_HEADER,
                       code="invalid_user")
    if scenario.cfg.users is None:
        raise ApiError(400, f"scenario {shown(scenario.name)} does not learn per user (its file has no users: "
                       f"block), so a request to it names no user", param=USER_HEADER, code="users_off")
    return name


def owner(request: web.Request, user_name: str | None) -> str:
    """Who a session belongs to: the token's name, and the user it speaks for (names hold no '/')."""
    name = grant(request).name
    return name if user_name is None else f"{name}/{user_name}"


def caller(request: web.Request) -> str:
    """`owner` before the scenario is known (to find a session or response it continues; nothing is served by
    this name until `user` has checked it)."""
    return owner(request, grant(request).user or request.headers.get(USER_HEADER))


def sees(request: web.Request, record: dict[str, Any]) -> bool:
    """Whether the request's token may read `record`: it covers its scenario, and a user's token its user."""
    g = grant(request)
    return g.covers(str(record.get("scenario"))) and (g.user is None or record.get("user") == g.user)


def reader(request: web.Request, asked: str | None = None) -> str | None:
    """The user whose records (or release line) a request is limited to: a user's token's own; else `asked`
    (default: the `user` query), if any."""
    g = grant(request)
    asked = asked if asked is not None else request.query.get("user") or None
    if g.user is not None and asked is not None and asked != g.user:
        raise ApiError(403, f"{g.describe()} reads its own user's only", param="user", code="permission_denied")
    return g.user if g.user is not None else asked


def line_of(request: web.Request, scenario: Scenario, asked: Any = None) -> str | None:
    """The user whose release line a request reads or writes (`reader`; `asked`: a body's `user`), checked: a
    name that can be one, on a scenario that learns per user (400); None: the shared line."""
    if asked is not None and not isinstance(asked, str):
        raise ApiError(400, "user: must be a user's name", param="user", code="invalid_user")
    name = reader(request, asked)
    if name is None:
        return None
    if (problem := user_problem(name)) is not None:
        raise ApiError(400, f"user: the user name {shown(name)} {problem}", param="user", code="invalid_user")
    if scenario.cfg.users is None:
        raise ApiError(400, f"scenario {shown(scenario.name)} does not learn per user (its file has no users: "
                       "block): it has one release line", param="user", code="users_off")
    return name


def sees_line(request: web.Request, user_name: str | None) -> bool:
    """Whether the request's token may read a release of `user_name`'s line (None: the shared line)."""
    g = grant(request)
    return user_name is None or g.user is None or g.user == user_name
