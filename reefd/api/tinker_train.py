"""The Tinker API's training calls: `create_model` (a LoRA of a scenario's base model, in a trainer process of its
own), `get_info`, `forward_backward` (also `forward`: forward_only) and `optim_step`. Each queues its work in the
model's seq_id order and answers with a future (reefd/api/tinker_state.py: retrieve_future).
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from reefd.api.errors import ApiError
from reefd.api.tinker_sessions import (
    body_of,
    field,
    future,
    model_of,
    new_model,
    owner,
    queue,
    refused,
    tinker_of,
    wire,
)
from reefd.tinker.futures import Failure, Outcome, Result
from reefd.tinker.models import Refused
from reefd.tinker.service import NotFound, TooMany


async def create_model(request: web.Request) -> web.Response:
    tinker, body = tinker_of(request), await body_of(request)
    lora = field(body, "lora_config", dict, {})
    rank = lora.get("rank", 32)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ApiError(400, "lora_config.rank: an integer is required", param="lora_config.rank",
                       code="invalid_request")
    new = new_model(request, body, field(body, "base_model", str), field(body, "model_seq_id", int), rank, lora)
    try:
        request_id = tinker.create_model(new, owner(request))
    except (TooMany, NotFound, Refused) as exc:
        raise refused(exc) from None
    return future(request_id, f"{new.session}:train:{new.seq}")


async def get_info(request: web.Request) -> web.Response:
    model = model_of(request, await body_of(request))
    return web.json_response({
        "type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
        "model_name": model.scenario,
        "model_data": {"model_name": model.scenario, "tokenizer_id": str(model.base)}})


async def forward_backward(request: web.Request) -> web.Response:
    tinker, who = tinker_of(request), owner(request)
    raw = await request.read()
    try:  # the model's vocabulary, once the body names the model
        req = wire.forward_backward(raw, lambda model_id: tinker.model(model_id, who).vocab_size or None)
        model = tinker.model(req.model_id, who)
    except wire.WireError as exc:
        if exc.model_id is not None and exc.seq_id is not None:  # its later requests need not wait for it
            with contextlib.suppress(NotFound):
                tinker.model(exc.model_id, who).pass_turn(exc.seq_id)
        raise ApiError(400, str(exc), code="invalid_request") from None
    except NotFound as exc:
        raise refused(exc) from None
    if req.tokens > tinker.limits.request_tokens:
        model.pass_turn(req.seq_id)
        raise ApiError(400, f"{req.tokens} tokens in one request; reefd takes at most "
                       f"{tinker.limits.request_tokens}", code="invalid_request")

    async def run() -> Outcome:
        reply = await model.call({"op": "forward_backward", "loss_fn": req.loss_fn, "config": req.config,
                                  "backward": req.backward,
                                  "data": [{"tokens": d.tokens, "inputs": d.inputs} for d in req.data]})
        if isinstance(reply, Failure):
            return reply
        model.tokens += int(reply["tokens"])
        return Result(proto=wire.forward_backward_output(reply["outputs"], {"loss:sum": reply["loss"]}))

    return queue(request, model, {"seq_id": req.seq_id}, "forward_backward" if req.backward else "forward", run)


_ADAM = {"learning_rate": "lr", "beta1": "beta1", "beta2": "beta2", "eps": "eps", "weight_decay": "weight_decay",
         "grad_clip_norm": "grad_clip_norm"}


async def optim_step(request: web.Request) -> web.Response:
    body = await body_of(request)
    model = model_of(request, body)
    adam = field(body, "adam_params", dict)
    step: dict[str, Any] = {"op": "optim_step"}
    for key, name in _ADAM.items():
        value = adam.get(key, 0.0 if key in ("weight_decay", "grad_clip_norm") else None)
        if not isinstance(value, int | float) or isinstance(value, bool) or value != value or \
                value in (float("inf"), float("-inf")) or value < 0:
            raise ApiError(400, f"adam_params.{key}: a finite number >= 0 is required, not {value!r}",
                           param=f"adam_params.{key}", code="invalid_request")
        step[name] = float(value)
    if not (0 <= step["beta1"] < 1 and 0 <= step["beta2"] < 1):
        raise ApiError(400, "adam_params: beta1 and beta2 must be in [0, 1)", param="adam_params",
                       code="invalid_request")

    async def run() -> Outcome:
        reply = await model.call(step)
        if isinstance(reply, Failure):
            return reply
        model.steps += 1
        return Result(json={"metrics": {"grad_norm:mean": reply["grad_norm"], "step:max": model.steps}})

    return queue(request, model, body, "optim_step", run)
