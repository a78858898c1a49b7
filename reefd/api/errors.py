"""Errors on the wire: one exception type, rendered in the caller's provider format, and the one place where
the domain's errors (unknown scenario, not serving, head conflict, pinned, engine and storage failures, ...)
become statuses and messages.

`/v1/messages*` callers get Anthropic's shape; everyone else gets OpenAI's.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
import orjson
from aiohttp import web

from reefd.attempts import AttemptError
from reefd.engines import EngineError, EngineUnavailable
from reefd.recipes import RecipeError
from reefd.records import ReportConflict, StorageError, UnknownReceipt
from reefd.releases import (
    BaseMismatch,
    HeadConflict,
    InvalidName,
    NoRelease,
    NothingToRollBack,
    Pinned,
    UnknownRelease,
    WrongScenario,
)
from reefd.scenarios import NotServing, UnknownScenario

SCENARIO_HEADER = "x-reef-scenario"

log = logging.getLogger("reefd.api")

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "permission_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """An answer other than success. `param` names the offending field path, if any."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def from_domain(exc: Exception) -> ApiError | None:
    """The answer for an error the domain raised (None: not one of those; a bug, then)."""
    match exc:
        case UnknownScenario(name=name, known=known):
            return ApiError(404, f"unknown scenario {name!r}; known scenarios: {', '.join(known) or '(none)'}",
                            param=SCENARIO_HEADER, code="scenario_not_found")
        case NotServing(name=name, why=why):
            return ApiError(503, f"scenario {name!r} is not serving yet{f': {why}' if why else '; retry shortly'}",
                            code="engine_unavailable", headers={"Retry-After": "2"})
        case NoRelease(scenario=name):
            return ApiError(503, f"scenario {name!r} has no base release yet; retry shortly",
                            code="engine_unavailable", headers={"Retry-After": "2"})
        case HeadConflict(scenario=name, expected=expected, actual=actual):
            return ApiError(409, f"the head of {name!r} is {actual}, not {expected}: another release was published "
                            "meanwhile; nothing was written", code="head_conflict", param="expected_head")
        case Pinned(scenario=name, pin=pin):
            return ApiError(409, f"scenario {name!r} is pinned to {pin} by its file (release.pin); set "
                            "release.pin: null and reload reefd before publishing, rolling back or promoting",
                            code="scenario_pinned")
        case BaseMismatch():
            return ApiError(409, f"{exc}; nothing was written (train or publish it again on the weights served now)",
                            code="base_mismatch")
        case NothingToRollBack():
            return ApiError(400, str(exc.args[0]), code="invalid_request", param="to")
        case WrongScenario():
            return ApiError(400, str(exc), code="wrong_scenario")
        case UnknownRelease():
            arg = str(exc.args[0]) if exc.args else ""
            return ApiError(404, arg if " " in arg else f"no release {arg!r}", code="release_not_found")
        case InvalidName(name=name):
            return ApiError(400, f"{name!r} is not a scenario name (1-64 letters, digits, '.', '_' or '-'; no '..')",
                            code="invalid_scenario_name", param="name")
        case EngineUnavailable():
            return ApiError(503, str(exc), code="engine_unavailable", headers={"Retry-After": str(exc.retry_after)})
        case EngineError():
            return ApiError(exc.status, str(exc), code=exc.code, param=exc.param)
        case StorageError():
            return ApiError(503, f"not stored: the record store cannot make writes durable ({exc})",
                            code="storage_unavailable", headers={"Retry-After": "5"})
        case UnknownReceipt(receipt=receipt, scenario=scenario):
            return ApiError(404, f"references: unknown receipt {receipt!r} in scenario {scenario!r}",
                            param="references", code="receipt_not_found")
        case ReportConflict(report_id=report_id):
            return ApiError(409, f"report_id {report_id!r} was already used with a different body", param="report_id",
                            code="report_conflict")
        case RecipeError():
            return ApiError(400, str(exc), code="invalid_recipe")
        case AttemptError(status=status, message=message, param=param, code=code):
            return ApiError(status, message, param=param, code=code)
    return None


def is_anthropic(request: web.Request) -> bool:
    path = request.path
    if path.startswith("/scenarios/"):
        path = "/" + path.split("/", 3)[-1]
    return path.startswith("/v1/messages")


def openai_body(err: ApiError) -> dict[str, Any]:
    etype = _OPENAI_TYPES.get(err.status, "server_error")
    return {"error": {"message": err.message, "type": etype, "param": err.param,
                      "code": err.code}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    etype = _ANTHROPIC_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


def json_response(body: Any, *, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer serialized by orjson (UTF-8, no ASCII escaping), off the hot path's budget."""
    return web.Response(body=orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")


def render(request: web.Request, err: ApiError) -> web.Response:
    body = anthropic_body(err) if is_anthropic(request) else openai_body(err)
    return json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return render(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route for {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}"
                   }.get(exc.status, exc.reason)
        return render(request, ApiError(exc.status, message))
    except Exception as exc:
        mapped = from_domain(exc)
        if mapped is not None:
            return render(request, mapped)
        log.exception("unhandled error on %s %s", request.method, request.path)
        return render(request, ApiError(500, "internal server error"))


class _Unrepresentable(str):
    """A number JSON cannot carry exactly: NaN, ±Infinity, 1e400, or an integer beyond 64 bits."""


def _float(text: str) -> float | _Unrepresentable:
    value = float(text)
    return value if math.isfinite(value) else _Unrepresentable(text)


def _int(text: str) -> int | _Unrepresentable:
    value = int(text)
    return value if -(2**63) <= value < 2**64 else _Unrepresentable(text)


def _first_unrepresentable(value: Any, path: str = "") -> tuple[str, str] | None:
    if isinstance(value, _Unrepresentable):
        return path, str(value)
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, item in items:
        found = _first_unrepresentable(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await request.read()
    if not raw:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = _slow_json(raw)  # the stdlib parser explains what is wrong, NaN included
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _slow_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw, parse_constant=_Unrepresentable, parse_float=_float,
                          parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    found = _first_unrepresentable(body)
    if found:
        path, text = found
        raise ApiError(400, f"{path}: {text} is not a finite number within 64 bits",
                       param=path or None)
    return body


def check(validator: jsonschema.protocols.Validator, body: Any, root: str = "") -> None:
    """Validate a request body; a 400 names the first bad field's full path."""
    errors = sorted(validator.iter_errors(body), key=lambda e: (len(e.absolute_path),
                                                               list(map(str, e.absolute_path))))
    if not errors:
        return
    err = errors[0]
    path = ".".join(str(p) for p in err.absolute_path)
    path = ".".join(p for p in (root, path) if p)
    message = err.message
    if err.validator == "required":
        message = message.replace("is a required property", "is required")
    raise ApiError(400, f"{path}: {message}" if path else message, param=path or None)
