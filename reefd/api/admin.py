"""The operator's API: health, readiness, status and record reads. Apart from agent traffic.

Knows the shapes `reefctl` reads; nothing here generates text.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from reefd import __version__, loop
from reefd.api import access
from reefd.api.errors import ApiError, json_response, shown
from reefd.engines import Replicated
from reefd.loop import ATTEMPTS, CHAIN, CONVERSATIONS, JUDGES, RECONCILER, RECORDS, REGISTRY, STARTED_AT, TRIALS
from reefd.observe.records import PRACTICE_FILTERS
from reefd.ops.auth import AUTHENTICATED
from reefd.serve.scenarios import Scenario

MAX_LIMIT = 1000


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when every scenario's engine generates, else 503. No token needed (a Kubernetes probe sends none), and
    then it says only that; with the token it also names each scenario's engine state."""
    registry = request.app[REGISTRY]
    ready = registry.ready
    body: dict[str, object] = {"ready": ready}
    if request.get(AUTHENTICATED):
        body["scenarios"] = {name: registry.scenarios[name].engine.describe()["state"]
                             for name in access.visible(request, registry.scenarios)}
    return json_response(body, status=200 if ready else 503)


def _users(request: web.Request, scenario: Scenario, limit: int) -> dict[str, int]:
    """A per-user scenario's users in /reef/status: how many there are (of `limit`, users.max) and how many have a
    line of their own (per-user figures are `reefctl users`; metrics carry no user label)."""
    known = request.app[REGISTRY].users.known(scenario.name)
    lines = request.app[RECONCILER].users
    return {"known": len(known), "max": limit,
            "own_lines": sum(lines.head(scenario.name, u) is not None for u in known)}


async def status(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    counts = await asyncio.to_thread(request.app[RECORDS].counts)
    scenarios = []
    chain = request.app[CHAIN]
    names = access.visible(request, registry.scenarios)
    heads = await asyncio.to_thread(lambda: {name: chain.head(name) for name in names})
    for name in names:
        s = registry.scenarios[name]
        c = counts.get(name, {})
        head = heads[name]
        drift = await asyncio.to_thread(request.app[RECONCILER].drift, s, head)
        engine = s.engine.describe()
        if isinstance(s.engine, Replicated) and (listed := await s.engine.replica_status()) is not None:
            engine["replicas"] = [{**r, "release": s.release} for r in listed]
        if (line := registry.admissions.get(id(s.engine))) is not None:
            engine["queue"] = line.describe()
        scenarios.append({"name": name, "model": s.cfg.model.name,
                          "engine": engine, "release": s.release,
                          "releases": {"declared": s.cfg.release.pin, "head": head.id if head else None,
                                       "serving": s.release, "adapter": s.binding.adapter if s.binding else None,
                                       "drift": drift},
                          # served traffic's; practice's are counted in its own section
                          "records": c.get("records", 0) - c.get("practice_records", 0),
                          "reports": c.get("reports", 0) - c.get("practice_reports", 0),
                          "sessions": request.app[CONVERSATIONS].counts(name),
                          **({"judge": request.app[JUDGES].status(name)}
                             if request.app[JUDGES].settings(s) is not None else {}),
                          **({"search": search} if (search := request.app[ATTEMPTS].summary(name)) else {}),
                          **({"practice": {**p, "records": c.get("practice_records", 0),
                                           "reports": c.get("practice_reports", 0)}}
                             if (p := request.app[loop.PRACTICE].status(name)) is not None else {}),
                          **({"canary": trial} if (trial := request.app[TRIALS].describe(name)) else {}),
                          **({"users": _users(request, s, s.cfg.users.max)} if s.cfg.users is not None else {})})
    return json_response({"version": __version__, "ready": registry.ready,
                              "uptime_s": round(time.time() - request.app[STARTED_AT], 3),
                              "scenarios": scenarios})


async def get_record(request: web.Request) -> web.Response:
    receipt = request.match_info["receipt"]
    record = await asyncio.to_thread(request.app[RECORDS].get_record, receipt)
    if record is None or not access.sees(request, record):
        raise ApiError(404, f"no record with receipt {shown(receipt)}", code="record_not_found")
    return json_response(record)


def practice_filter(request: web.Request) -> str:
    """The `practice` query of a records listing: include (the default), exclude or only."""
    raw = request.query.get("practice") or "include"
    if raw not in PRACTICE_FILTERS:
        raise ApiError(400, f"practice: {shown(raw)} is not one of {', '.join(PRACTICE_FILTERS)}", param="practice")
    return raw


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return 50
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"limit: {shown(raw)} is not an integer", param="limit") from None
    if not 1 <= value <= MAX_LIMIT:
        raise ApiError(400, f"limit: must be between 1 and {MAX_LIMIT}", param="limit")
    return value


async def list_records(request: web.Request) -> web.Response:
    scenario = access.scenario(request, request.match_info["name"], param="name")
    limit = _limit(request.query.get("limit"))
    after = request.query.get("after") or None
    if after is not None and len(after) > 64:
        raise ApiError(400, "after: not a receipt", param="after")
    # unpacking up to a thousand records is off the event loop, so streams keep flowing
    rows = await asyncio.to_thread(request.app[RECORDS].list_records, scenario.name, after=after,
                                   limit=limit + 1, session=request.query.get("session") or None,
                                   practice=practice_filter(request), user=access.reader(request))
    data = rows[:limit]
    return json_response({"object": "list", "data": data, "has_more": len(rows) > limit,
                              "last_id": data[-1]["id"] if data else None})
