"""Errors on the wire: one exception type, rendered in the caller's provider format, and the one place where
the domain's errors (unknown scenario, not serving, head conflict, pinned, engine and storage failures, ...)
become statuses and messages.

`/v1/messages*` callers get Anthropic's shape; everyone else gets OpenAI's.
"""

from __future__ import annotations

import errno
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
import jsonschema_rs
import orjson
from aiohttp import web

from reefd.commit.chain import (
    BaseMismatch,
    HeadConflict,
    InvalidName,
    NoRelease,
    NothingToRollBack,
    Pinned,
    ReleaseError,
    TrialRefused,
    UnknownRelease,
    WrongScenario,
)
from reefd.commit.chain_types import WeightsRefused
from reefd.engines import EngineError, EngineUnavailable
from reefd.grow.attempts import AttemptError
from reefd.grow.recipes import RecipeError
from reefd.observe.records import ReportConflict, StorageError, UnknownReceipt
from reefd.serve.admission import Left, Overloaded
from reefd.serve.scenarios import NotServing, UnknownScenario
from reefd.serve.tenancy import BeingDeleted, UsersFull

SCENARIO_HEADER = "x-reef-scenario"

log = logging.getLogger("reefd.api")

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


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


def disk_full(exc: BaseException) -> bool:
    """A write refused for want of space: ENOSPC or a quota (OSError), or a library's error that says so (git)."""
    return (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "No space left on device" in str(exc)


def from_domain(exc: Exception) -> ApiError | None:
    """The answer for an error the domain raised (None: not one of those; a bug, then)."""
    if disk_full(exc) and not isinstance(exc, StorageError):
        return ApiError(503, "not stored: no space left on device in reefd's state folder; nothing was written. "
                        "Free some space and retry", code="storage_full", headers={"Retry-After": "60"})
    if isinstance(exc, ReleaseError) and (answer := _from_chain(exc)) is not None:
        return answer
    match exc:
        case UnknownScenario(name=name, known=known):
            return ApiError(404, f"unknown scenario {shown(name)}; known scenarios: {', '.join(known) or '(none)'}",
                            param=SCENARIO_HEADER, code="scenario_not_found")
        case NotServing(name=name, why=why):
            return ApiError(503, f"scenario {name!r} is not serving yet{f': {why}' if why else '; retry shortly'}",
                            code="engine_unavailable", headers={"Retry-After": "2"})
        case NoRelease(scenario=name):
            return ApiError(503, f"scenario {name!r} has no base release yet; retry shortly",
                            code="engine_unavailable", headers={"Retry-After": "2"})
        case Left():  # nobody reads this answer; the status is for the access log and the metrics
            return ApiError(499, str(exc), code="client_closed")
        case Overloaded(status=status, retry_after=after):
            return ApiError(status, str(exc), code="rate_limit_exceeded" if status == 429 else "engine_overloaded",
                            headers={"Retry-After": str(after)})
        case EngineUnavailable():
            return ApiError(503, str(exc), code="engine_unavailable", headers={"Retry-After": str(exc.retry_after)})
        case EngineError():
            return ApiError(exc.status, str(exc), code=exc.code, param=exc.param)
        case StorageError():
            return ApiError(503, f"not stored: the record store cannot make writes durable ({exc})",
                            code="storage_unavailable", headers={"Retry-After": "5"})
        case UnknownReceipt(receipt=receipt, scenario=scenario):
            return ApiError(404, f"references: unknown receipt {shown(receipt)} in scenario {shown(scenario)}",
                            param="references", code="receipt_not_found")
        case ReportConflict(report_id=report_id):
            return ApiError(409, f"report_id {shown(report_id)} was already used with a different body",
                            param="report_id", code="report_conflict")
        case UsersFull():
            return ApiError(403, str(exc), param="x-reef-user", code="user_limit_reached")
        case BeingDeleted():
            return ApiError(409, str(exc), param="x-reef-user", code="user_being_deleted")
        case RecipeError():
            return ApiError(400, str(exc), code="invalid_recipe")
        case AttemptError(status=status, message=message, param=param, code=code):
            return ApiError(status, message, param=param, code=code)
    return None


def _from_chain(exc: ReleaseError) -> ApiError | None:
    """The answer for a release chain's refusal."""
    match exc:
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
        case TrialRefused():
            return ApiError(409, f"{exc}; nothing was written", code="trial_needs_replicas")
        case WeightsRefused():
            return ApiError(409, f"{exc}; nothing was written", code="weights_refused")
        case NothingToRollBack():
            return ApiError(400, str(exc.args[0]), code="invalid_request", param="to")
        case WrongScenario():
            return ApiError(400, str(exc), code="wrong_scenario")
        case UnknownRelease():
            arg = str(exc.args[0]) if exc.args else ""
            return ApiError(404, shown_text(arg) if " " in arg else f"no release {shown(arg)}",
                            code="release_not_found")
        case InvalidName(name=name):
            return ApiError(400, f"{shown(name)} is not a scenario name (1-64 letters, digits, '.', '_' or '-'; "
                            "no '..')", code="invalid_scenario_name", param="name")
    return None


def is_anthropic(request: web.Request) -> bool:
    path = request.path
    if path.startswith("/scenarios/"):
        path = "/" + path.split("/", 3)[-1]
    return path.startswith("/v1/messages")


_DEFAULT_CODES = {413: "request_too_large", 415: "unsupported_media_type", 429: "rate_limit_exceeded",
                  500: "internal_error", 502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


def openai_body(err: ApiError) -> dict[str, Any]:
    etype = _OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": etype, "param": err.param,
                      "code": err.code or _DEFAULT_CODES.get(err.status)}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    etype = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


def json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer serialized by orjson (UTF-8, no ASCII escaping), off the hot path's budget."""
    return web.Response(body=orjson.dumps(body), status=status, headers=headers, content_type="application/json")


def render(request: web.Request, err: ApiError) -> web.Response:
    body = anthropic_body(err) if is_anthropic(request) else openai_body(err)
    return json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return render(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route for {shown_text(request.method, 20)} {shown_text(request.path)}",
                   405: f"method {shown_text(request.method, 20)} not allowed on {shown_text(request.path)}"
                   }.get(exc.status, exc.reason)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405 names the methods
        return render(request, ApiError(exc.status, message, headers=allow))
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
    if len(text) > 21:  # past 64 bits (20 digits and a sign), before int(), which refuses 4,300 digits or more
        return _Unrepresentable(text)
    value = int(text)
    return value if -(2**63) <= value < 2**64 else _Unrepresentable(text)


class _Surrogate(str):
    """A lone UTF-16 surrogate the stdlib parser let through (it cannot be stored or sent as UTF-8)."""


def _first_unrepresentable(value: Any, path: str = "") -> tuple[str, str] | None:
    if isinstance(value, _Unrepresentable):
        return path, str(value)
    if isinstance(value, str):
        return _surrogate(value, path)
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{path}.{key}" if path else str(key)
        found = (_surrogate(key, sub) if isinstance(key, str) else None) or _first_unrepresentable(item, sub)
        if found:
            return found
    return None


def _surrogate(text: str, path: str) -> tuple[str, str] | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return path, _Surrogate(f"\\u{ord(text[exc.start]):04x}")
    return None


MAX_DEPTH = 128  # arrays and objects inside each other; no provider body comes near it


async def read_body(request: web.Request) -> bytes:
    """The request body, decompressed as its Content-Encoding says, or a 400 when it cannot be."""
    try:
        return await request.read()
    except web.RequestPayloadError as exc:  # e.g. `Content-Encoding: gzip` on bytes that are not gzip
        encoding = request.headers.get("Content-Encoding", "identity")
        raise ApiError(400, f"the request body could not be read (Content-Encoding: {shown(encoding, 40)}): "
                            f"{str(exc).splitlines()[-1].strip()}") from None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await read_body(request)
    if not raw:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = _slow_json(raw)  # the stdlib parser explains what is wrong, NaN included
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # fewer brackets than that cannot nest past it
        _check_depth(body)
    return body


def _slow_json(raw: bytes) -> Any:
    _check_raw_depth(raw)
    try:
        body = json.loads(raw, parse_constant=_Unrepresentable, parse_float=_float, parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep") from None
    found = _first_unrepresentable(body)
    if found:
        path, text = found
        if isinstance(text, _Surrogate):
            raise ApiError(400, f"{path or 'the body'}: a lone UTF-16 surrogate ({text}) is not a character; "
                                "send valid Unicode", param=path or None)
        raise ApiError(400, f"{path}: {shown_text(text, 60)} is not a finite number within 64 bits",
                       param=path or None)
    return body


def _check_raw_depth(raw: bytes) -> None:
    """A 400 for JSON text nested past MAX_DEPTH, found by counting brackets outside strings (the parsers recurse)."""
    depth, in_string, escaped = 0, False, False
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def _check_depth(body: Any) -> None:
    """A 400 for a parsed body nested past MAX_DEPTH, before anything (generation, a record) depends on it."""
    level = [body]
    for _ in range(MAX_DEPTH):
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item)
                 if isinstance(v, dict | list)]
        if not level:
            return
    raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep")


def shown(value: object, limit: int = 200) -> str:
    """`value` as an error message may echo it: its repr, cut to `limit` characters."""
    return shown_text(repr(value), limit)


def shown_text(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} chars)"


class BodySchema:
    """A request body's JSON Schema (2020-12). jsonschema-rs accepts a good body in microseconds (jsonschema takes
    1-2 ms on an agent's first turn); jsonschema, the reference, names the first bad field of a refused one."""

    def __init__(self, schema: dict[str, Any]):
        self.schema = schema
        self._fast = jsonschema_rs.Draft202012Validator(schema, validate_formats=False)
        self._full = jsonschema.Draft202012Validator(schema)

    def check(self, body: Any, root: str = "") -> None:
        """Validate a request body; a 400 names the first bad field's full path."""
        try:
            if self._fast.is_valid(body):
                return
        except (ValueError, OverflowError, RecursionError):  # what it cannot take, the reference judges
            pass
        try:
            errors = sorted(self._full.iter_errors(body), key=lambda e: (len(e.absolute_path),
                                                                         list(map(str, e.absolute_path))))
        except RecursionError:  # a value nested past what the validator (or its message) can walk
            raise ApiError(400, f"{root or 'the body'}: nested too deeply to check") from None
        if not errors:
            return
        err = errors[0]
        path = ".".join(p for p in (root, ".".join(str(p) for p in err.absolute_path)) if p)
        message = err.message
        if err.validator == "required":
            message = message.replace("is a required property", "is required")
        raise ApiError(400, f"{path}: {message}" if path else message, param=path or None)
