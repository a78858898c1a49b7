"""`POST /reef/report`: feedback attached to receipts, validated, idempotent by report_id.

Knows the report body's schema; storage rules live in records.py, and its errors' answers in api/errors.py.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from reefd.api.errors import BodySchema, json_response, read_json
from reefd.api.turns import scenario_of
from reefd.loop import ATTEMPTS, RECORDS

MAX_REFERENCES = 10_000  # a report's records; each one checked in the write transaction, and again by retention

REPORT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["references"], "additionalProperties": False,
    "properties": {
        "score": {"type": "number", "description": "A finite number; booleans are rejected."},
        "feedback": {"type": ["string", "object"]},
        "references": {"type": "array", "minItems": 1, "maxItems": MAX_REFERENCES,
                       "items": {"type": "string", "minLength": 1}},
        "metadata": {"type": "object"},
        "report_id": {"type": "string", "minLength": 1, "maxLength": 200},
    },
}
_BODY = BodySchema(REPORT_SCHEMA)


async def report(request: web.Request) -> web.Response:
    scenario = scenario_of(request)
    body = await read_json(request)
    _BODY.check(body)
    attempts = request.app[ATTEMPTS]
    if attempts.handles(scenario):  # a search scenario: the report is an attempt's score at a grid coordinate
        stored, _created = await attempts.report(scenario.name, body)
    else:
        stored, _created = await request.app[RECORDS].put_report(scenario.name, body)
    return json_response({"object": "reef.report", **stored})
