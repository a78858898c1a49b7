"""The Tinker training API under /api/v1/, as the `tinker` SDK (0.38.0) calls it: sessions, LoRA models on a
scenario's base model, forward/backward passes, optimizer steps, checkpoints, and futures. A model's `base_model`
names the scenario; the token (scope `train`, handed to the SDK as `tml-TOKEN`) decides which scenarios and whose
line. Work runs in the model's trainer process (reefd/tinker); a request that cannot be done as sent is a 400 with
a JSON body, one a bound refuses a 429 the SDK is told not to retry.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError
from reefd.loop import REGISTRY, TINKER
from reefd.tinker.futures import Outcome
from reefd.tinker.models import Refused, TinkerModel
from reefd.tinker.service import NewModel, NotFound, Tinker, TooMany

try:  # the protobuf bodies need protobuf and numpy: the `tinker` extra
    from reefd.tinker import wire
except ImportError:  # pragma: no cover - without the extra every route but the two health ones answers 501
    wire = None  # type: ignore[assignment]

INSTALL_HINT = "the Tinker API needs the tinker extra: pip install 'reefd[tinker]'"
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
    "custom_loss_server_side": False, "parallel_fwdbwd_chunks": False,
}


def tinker_of(request: web.Request) -> Tinker:
    if wire is None:
        raise ApiError(501, INSTALL_HINT, code="not_installed")
    return request.app[TINKER]


def owner(request: web.Request) -> str:
    return access.grant(request).name


async def body_of(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        raise ApiError(400, "the body is not JSON", code="invalid_request") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_request")
    return body


def field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ... or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(400, f"{name}: a {kind.__name__} is required", param=name, code="invalid_request")
    return value


def refused(exc: Exception) -> ApiError:
    if isinstance(exc, TooMany):
        return ApiError(429, str(exc), code="rate_limited", headers={"x-should-retry": "false"})
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), code="not_found")
    return ApiError(400, str(exc), code="invalid_request")


def future(request_id: str, model_id: str | None = None) -> web.Response:
    return web.json_response({"request_id": request_id, "model_id": model_id})


# ---------------------------------------------------------------- client and session


async def client_config(request: web.Request) -> web.Response:
    tinker_of(request)
    return web.json_response(CLIENT_CONFIG)


async def dynamic_config(request: web.Request) -> web.Response:
    return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


async def create_session(request: web.Request) -> web.Response:
    await body_of(request)
    try:
        session_id = tinker_of(request).create_session(owner(request))
    except TooMany as exc:
        raise refused(exc) from None
    return web.json_response({"type": "create_session", "session_id": session_id})


async def heartbeat(request: web.Request) -> web.Response:
    body = await body_of(request)
    try:
        tinker_of(request).session(field(body, "session_id", str), owner(request))
    except NotFound as exc:
        raise ApiError(410, str(exc), code="session_ended") from None  # the SDK stops its heartbeat
    return web.json_response({"type": "session_heartbeat"})


async def finish_session(request: web.Request) -> web.Response:
    tinker = tinker_of(request)
    session_id = request.match_info["session_id"]
    try:
        tinker.session(session_id, owner(request))
    except NotFound as exc:
        raise refused(exc) from None
    await tinker.close_session(session_id)
    return web.json_response({})


async def telemetry(request: web.Request) -> web.Response:
    await request.read()  # the SDK's own telemetry: reefd keeps none of it
    return web.json_response({"status": "accepted"})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def capabilities(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    models = []
    for name in access.visible(request, registry.scenarios):
        folder = registry.scenarios[name].engine.model_folder()
        if folder is not None:
            models.append({"model_name": name, "trainable": True,
                           "sampleable": registry.scenarios[name].samples_tokens is not None})
    return web.json_response({"supported_models": models})


def new_model(request: web.Request, body: dict[str, Any], scenario_name: str, seq: int, rank: int,
               lora: dict[str, Any]) -> NewModel:
    scenario = access.scenario(request, scenario_name, param="base_model")
    base = scenario.engine.model_folder()
    if base is None:
        raise ApiError(503, f"scenario {scenario_name!r}: its model is still being prepared, or is remote (an "
                       "upstream provider's model cannot be trained here)", code="engine_unavailable",
                       headers={"Retry-After": "5"})
    if ":" in str(base):
        raise ApiError(500, f"the base model's folder {base} holds a ':' (the SDK cuts a tokenizer path there)")
    return NewModel(field(body, "session_id", str), seq, scenario.name, access.line_of(request, scenario), base,
                    rank, bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True)),
                    int(lora.get("seed") or 0))


def model_of(request: web.Request, body: dict[str, Any]) -> TinkerModel:
    try:
        return tinker_of(request).model(field(body, "model_id", str), owner(request))
    except NotFound as exc:
        raise refused(exc) from None


def queue(request: web.Request, model: TinkerModel, body: dict[str, Any], kind: str,
           work: Callable[[], Awaitable[Outcome]]) -> web.Response:
    try:
        request_id = tinker_of(request).submit(model, field(body, "seq_id", int), kind, work)
    except (Refused, TooMany) as exc:
        raise refused(exc) from None
    return future(request_id, model.id)
