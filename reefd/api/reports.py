"""`POST /reef/report`: feedback attached to receipts, validated, idempotent by report_id.

Knows the report body's schema; storage rules live in records.py, and its errors' answers in api/errors.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from reefd.api import access
from reefd.api.errors import SCENARIO_HEADER, ApiError, BodySchema, json_response, read_json
from reefd.api.turns import scenario_of
from reefd.loop import ATTEMPTS, RECORDS
from reefd.observe.report_store import MAX_REPORT_FIELD_BYTES, MAX_SCORE, UnknownReceipt
from reefd.serve.scenarios import Scenario

MAX_REFERENCES = 10_000  # a report's records; each one checked in the write transaction, and again by retention

REPORT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["references"], "additionalProperties": False,
    "properties": {
        "score": {"type": "number", "minimum": -MAX_SCORE, "maximum": MAX_SCORE,
                  "description": f"A finite number in [-{MAX_SCORE:g}, {MAX_SCORE:g}]; booleans are rejected."},
        "feedback": {"type": ["string", "object"]},
        "references": {"type": "array", "minItems": 1, "maxItems": MAX_REFERENCES,
                       "items": {"type": "string", "minLength": 1}},
        "metadata": {"type": "object"},
        "report_id": {"type": "string", "minLength": 1, "maxLength": 200},
    },
}
_BODY = BodySchema(REPORT_SCHEMA)


async def report(request: web.Request) -> web.Response:
    body = await read_json(request)
    _BODY.check(body)
    named = request.match_info.get("scenario") or request.headers.get(SCENARIO_HEADER)
    scenario = scenario_of(request) if named else await asyncio.to_thread(_of_references, request, body)
    for field in ("metadata", "feedback"):
        if field in body and len(orjson.dumps(body[field])) > MAX_REPORT_FIELD_BYTES:
            raise ApiError(413, f"{field}: more than {MAX_REPORT_FIELD_BYTES // 1024} KiB as JSON; a report's "
                           f"{field} is kept with every record it references", param=field,
                           code="report_too_large")
    user = await asyncio.to_thread(_whose, request, scenario, body)
    attempts = request.app[ATTEMPTS]
    if attempts.handles(scenario):  # a search scenario: the report is an attempt's score at a grid coordinate
        stored, _created = await attempts.report(scenario.name, body)
    else:
        stored, _created = await request.app[RECORDS].put_report(scenario.name, body, user=user)
    return json_response({"object": "reef.report", **stored})


def _of_references(request: web.Request, body: dict[str, Any]) -> Scenario:
    """For a report that names no scenario: the scenario that served the record it references first (the store
    then checks that every reference is one of its records); else the 400 (blocking)."""
    references = body.get("references") or []
    record = request.app[RECORDS].get_record(references[0]) if references and isinstance(references[0], str) \
        else None
    name = record.get("scenario") if isinstance(record, dict) else None
    if isinstance(name, str) and access.covers(request, name):
        return access.scenario(request, name)
    return scenario_of(request)


def _whose(request: web.Request, scenario: Scenario, body: dict[str, Any]) -> str | None:
    """The user whose records a report references, on a scenario that learns per user (None: nobody's, or
    several users'). A user's token reports on its own user's records only: another user's record is one that
    does not exist (UnknownReceipt). Blocking."""
    if scenario.cfg.users is None and access.grant(request).user is None:
        return None
    users = set()
    for ref in body.get("references") or []:
        record = request.app[RECORDS].get_record(ref) if isinstance(ref, str) else None
        if record is None or not access.sees(request, record):
            raise UnknownReceipt(str(ref), scenario.name)
        users.add(record.get("user"))
    return users.pop() if len(users) == 1 else None
