"""A scenario's users: who they are, what serves each of them, and their records and reports
(`GET /reef/scenarios/{name}/users`, `reefctl users`). A user's token sees its own user only."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError, json_response, shown
from reefd.loop import RECONCILER, RECORDS, REGISTRY


async def list_users(request: web.Request) -> web.Response:
    scenario = access.scenario(request, request.match_info["name"], param="name")
    if scenario.cfg.users is None:
        raise ApiError(400, f"scenario {shown(scenario.name)} does not learn per user (its file has no users: block)",
                       param="name", code="users_off")
    known = request.app[REGISTRY].users.known(scenario.name)
    counts = await asyncio.to_thread(request.app[RECORDS].user_counts, scenario.name)
    lines = request.app[RECONCILER].users
    only = access.grant(request).user
    rows: list[dict[str, Any]] = []
    for name in sorted(known):
        if only is not None and name != only:
            continue
        own, why = lines.head(scenario.name, name), lines.why(scenario.name, name)
        rows.append({"user": name, "since": known[name].get("since"), "own_release": own,
                     "release": own if own is not None and why is None else scenario.release,
                     **({"why": why} if why else {}),
                     **counts.get(name, {"records": 0, "reports": 0})})
    return json_response({"object": "list", "scenario": scenario.name, "max": scenario.cfg.users.max,
                          "slots": scenario.cfg.users.slots, "shared_release": scenario.release, "data": rows})
