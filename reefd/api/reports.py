"""`POST /reef/report`: feedback attached to receipts, validated, idempotent by report_id.

Knows the report body's schema and its HTTP answers; storage rules live in records.py.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from aiohttp import web

from reefd.api.errors import ApiError, check, json_response, read_json
from reefd.api.keys import REGISTRY, SCHEDULER, STORE
from reefd.records import ReportConflict, StorageError, UnknownReceipt

REPORT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["references"], "additionalProperties": False,
    "properties": {
        "score": {"type": "number", "description": "A finite number; booleans are rejected."},
        "feedback": {"type": ["string", "object"]},
        "references": {"type": "array", "minItems": 1,
                       "items": {"type": "string", "minLength": 1}},
        "metadata": {"type": "object"},
        "report_id": {"type": "string", "minLength": 1, "maxLength": 200},
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(REPORT_SCHEMA)


async def report(request: web.Request) -> web.Response:
    scenario = request.app[REGISTRY].resolve(request)
    body = await read_json(request)
    check(_VALIDATOR, body)
    try:
        stored, _created = await request.app[STORE].put_report(scenario.name, body)
        request.app[SCHEDULER].check(scenario.name)
    except UnknownReceipt as exc:
        raise ApiError(404, f"references: unknown receipt {exc.receipt!r} in scenario "
                       f"{scenario.name!r}", param="references", code="receipt_not_found"
                       ) from exc
    except ReportConflict as exc:
        raise ApiError(409, f"report_id {body.get('report_id')!r} was already used with a "
                       "different body", param="report_id", code="report_conflict") from exc
    except StorageError as exc:
        raise ApiError(503, f"the report could not be stored durably: {exc}",
                       headers={"Retry-After": "5"}) from exc
    return json_response({"object": "reef.report", **stored})
