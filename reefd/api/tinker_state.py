"""The Tinker API's checkpoints and futures: `save_weights` (a training state: the LoRA and its optimizer),
`save_weights_for_sampler` (the LoRA alone), `load_weights` (into a model, or a new model made from a checkpoint:
`create_training_client_from_state`), and `retrieve_future`, which waits up to Futures.WAIT_S for a request's
result and otherwise says try again. A checkpoint is `tinker://RUN/weights/NAME` or `.../sampler_weights/NAME`;
saving over one that exists fails unless the request says overwrite, and leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError
from reefd.api.tinker_sample import target
from reefd.api.tinker_sessions import body_of, field, future, model_of, new_model, owner, queue, refused, tinker_of
from reefd.engines import EngineError, EngineUnavailable
from reefd.tinker.futures import Failure, Outcome, Result
from reefd.tinker.models import Checkpoint, Refused, TinkerModel, check_name
from reefd.tinker.sampling import EPHEMERAL
from reefd.tinker.service import NotFound, Tinker, TooMany

log = logging.getLogger("reefd.tinker")


def _name(body: dict[str, Any]) -> str:
    try:
        return check_name(field(body, "path", str))
    except Refused as exc:
        raise ApiError(400, str(exc), param="path", code="invalid_request") from None


async def save_weights(request: web.Request) -> web.Response:
    body = await body_of(request)
    model, name = model_of(request, body), _name(body)
    overwrite = bool(body.get("overwrite", False))

    async def run() -> Outcome:
        return await model.save("weights", name, overwrite)

    return queue(request, model, body, "save_weights", run)


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    """Under the request's name, and offered to the line's gate as a candidate (its job's id in the answer's
    `reef_job`); or, without a name (save_weights_and_get_sampling_client), as `ephemeral-SEQ`, the loop's own,
    with a sampling session of the model's session opened on it."""
    body = await body_of(request)
    model = model_of(request, body)
    tinker = tinker_of(request)
    if body.get("path") is None:
        seq = field(body, "sampling_session_seq_id", int)
        name, overwrite, where = f"{EPHEMERAL}{field(body, 'seq_id', int)}", True, target(request, model.scenario,
                                                                                           None)
    else:
        name, overwrite, where = _name(body), bool(body.get("overwrite", False)), None

    async def run() -> Outcome:
        saved = await model.save("sampler_weights", name, overwrite)
        if not isinstance(saved, Result) or saved.json is None:
            return saved
        point = model.checkpoint("sampler_weights", name)
        if where is None:
            return Result(json={**saved.json, "reef_job": await _offer(tinker, model, point)})
        try:
            sampler = await dataclasses.replace(where, point=point).open(tinker.samplers, model.session, seq)
        except (EngineError, EngineUnavailable) as exc:
            return Failure(f"{point.path} was saved, but the engine could not load it: {exc}", "server")
        return Result(json={**saved.json, "sampling_session_id": sampler.id})

    return queue(request, model, body, "save_weights_for_sampler", run)


async def _offer(tinker: Tinker, model: TinkerModel, point: Checkpoint) -> str | None:
    """`point` to the gate of `model`'s line: the job's id (None: reefd could not queue it; its log says why)."""
    if tinker.offer is None:
        return None
    meta = {"source": "tinker", "summary": f"Tinker checkpoint {point.path}",
            "params": {"recipe": "tinker", "rank": model.rank},
            "tinker": {"checkpoint": point.path, "model_id": model.id, "session": model.session,
                       "steps": model.steps, "tokens": model.tokens,
                       "sampled": list(tinker.samplers.sampled.get(model.run, ()))}}
    try:
        job = await tinker.offer(model.scenario, model.user, point.folder, meta)
    except (OSError, KeyError) as exc:
        log.warning("%s: %s was saved, but not offered to the gate: %s", model.scenario, point.path, exc)
        return None
    return str(job.id)


def _checkpoint(request: web.Request, body: dict[str, Any]) -> Checkpoint:
    tinker = tinker_of(request)
    try:
        return tinker.checkpoint(field(body, "path", str), lambda name: access.covers(request, name))
    except (Refused, NotFound) as exc:
        raise refused(exc) from None


async def load_weights(request: web.Request) -> web.Response:
    """Into the model named (`model_id`, `seq_id`), or a new model `session_id:train:model_seq_id` made from the
    checkpoint, on the scenario it was trained for."""
    body = await body_of(request)
    point = _checkpoint(request, body)
    optimizer = bool(body.get("optimizer", False))
    if point.kind != "weights" and optimizer:
        raise ApiError(400, f"{point.path} holds sampler weights, without an optimizer state; load it without "
                       "the optimizer, or load a save_state checkpoint", param="path", code="invalid_request")
    if "model_id" in body:
        model = model_of(request, body)

        async def run() -> Outcome:
            if point.meta()["rank"] != model.rank:
                return Failure(f"{point.path} has rank {point.meta()['rank']}; this model's is {model.rank}", "user")
            return await model.load(point, optimizer)

        return queue(request, model, body, "load_weights", run)
    meta = point.meta()
    new = new_model(request, body, str(meta["scenario"]), field(body, "model_seq_id", int), int(meta["rank"]), {})
    if new.user != meta.get("user"):
        raise ApiError(404, f"no checkpoint {point.path}", code="not_found")  # another user's: as if none
    try:
        request_id = tinker_of(request).create_model(new, owner(request), then=point, optimizer=optimizer)
    except (TooMany, NotFound, Refused) as exc:
        raise refused(exc) from None
    return future(request_id, f"{new.session}:train:{new.seq}")


async def retrieve_future(request: web.Request) -> web.Response:
    tinker, body = tinker_of(request), await body_of(request)
    request_id = field(body, "request_id", str)
    try:
        outcome = await tinker.futures.retrieve(request_id)
    except KeyError:
        raise ApiError(404, f"no future {request_id!r} (never made, or its result expired after "
                       f"{tinker.futures.KEEP_S:.0f} s)", code="not_found") from None
    if outcome is None:
        return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if isinstance(outcome, Failure):
        return web.json_response({"error": outcome.message, "category": outcome.category})
    assert isinstance(outcome, Result)
    if outcome.proto is not None:
        return web.Response(body=outcome.proto, content_type="application/x-protobuf")
    return web.json_response(outcome.json)
