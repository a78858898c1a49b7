"""`POST /reef/report`: feedback attached to receipts, validated, idempotent by report_id.

Knows the report body's schema; storage rules live in records.py, and its errors' answers in api/errors.py.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from reefd.api.errors import ApiError, BodySchema, json_response, read_json
from reefd.api.turns import scenario_of
from reefd.loop import ATTEMPTS, RECORDS
from reefd.observe.report_store import MAX_REPORT_FIELD_BYTES, MAX_SCORE

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
    scenario = scenario_of(request)
    body = await read_json(request)
    _BODY.check(body)
    for field in ("metadata", "feedback"):
        if field in body and len(orjson.dumps(body[field])) > MAX_REPORT_FIELD_BYTES:
            raise ApiError(413, f"{field}: more than {MAX_REPORT_FIELD_BYTES // 1024} KiB as JSON; a report's "
                           f"{field} is kept with every record it references", param=field,
                           code="report_too_large")
    attempts = request.app[ATTEMPTS]
    if attempts.handles(scenario):  # a search scenario: the report is an attempt's score at a grid coordinate
        stored, _created = await attempts.report(scenario.name, body)
    else:
        stored, _created = await request.app[RECORDS].put_report(scenario.name, body)
    return json_response({"object": "reef.report", **stored})
