"""The Tinker API's sampling routes: `create_sampling_session` (the base model of a scenario, or a checkpoint
loaded into its engine), `GET /api/v1/samplers/{id}`, and `asample`, whose future's result is the samples; every
sample is a record, its receipt the sampled sequence's id (reefd/tinker/sampling.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError
from reefd.api.tinker_sessions import body_of, field, owner, refused, tinker_of
from reefd.engines import EngineError, EngineUnavailable, TokenSample
from reefd.loop import RECORDS
from reefd.observe.receipts import new_receipt
from reefd.serve.scenarios import Scenario
from reefd.tinker.models import Checkpoint, Refused
from reefd.tinker.sampling import Sampler, Samplers, sample_work, stop_of
from reefd.tinker.service import NotFound

MAX_SAMPLES = 64  # num_samples in one request


def _engine_of(scenario: Scenario) -> Any:
    if scenario.samples_tokens is None:
        raise ApiError(400, f"scenario {scenario.name!r}: its {scenario.engine.kind} engine cannot sample from token "
                       "ids (an upstream provider's model)", code="invalid_request")
    return scenario.samples_tokens


@dataclass(frozen=True)
class Target:
    """What a sampler samples, checked against the asking token: a scenario (its line: `user`), and a checkpoint
    of that line (None: the base model)."""

    scenario: Scenario
    user: str | None
    point: Checkpoint | None

    async def open(self, samplers: Samplers, session: str, seq: int) -> Sampler:
        """The sampler of `session` numbered `seq` (the checkpoint loaded into the scenario's engine first)."""
        adapter = None if self.point is None else await samplers.adapter_for(self.scenario.engine, self.point)
        sampler = Sampler(f"{session}:sample:{seq}", session, self.scenario.name, self.user,
                          _engine_of(self.scenario), adapter, self.point.path if self.point else None)
        samplers.samplers[sampler.id] = sampler
        return sampler


def target(request: web.Request, scenario_name: str, point: Checkpoint | None) -> Target:
    scenario = access.scenario(request, scenario_name, param="base_model")
    user = access.line_of(request, scenario)
    if point is not None and user != point.meta().get("user"):
        raise ApiError(404, f"no checkpoint {point.path}", code="not_found")  # another user's: as if none
    _engine_of(scenario)
    return Target(scenario, user, point)


async def open_sampler(request: web.Request, session: str, seq: int, where: Target) -> Sampler:
    try:
        return await where.open(tinker_of(request).samplers, session, seq)
    except EngineUnavailable as exc:
        raise ApiError(503, f"scenario {where.scenario.name!r}: {exc}", code="engine_unavailable",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except EngineError as exc:
        raise ApiError(exc.status if exc.status < 500 else 502, str(exc), code="invalid_adapter") from None


async def create_sampling_session(request: web.Request) -> web.Response:
    tinker, body = tinker_of(request), await body_of(request)
    session = field(body, "session_id", str)
    seq = field(body, "sampling_session_seq_id", int)
    try:
        tinker.session(session, owner(request))
        point = None
        if body.get("model_path") is not None:
            point = tinker.checkpoint(field(body, "model_path", str), lambda name: access.covers(request, name))
            scenario_name = str(point.meta()["scenario"])
        else:
            scenario_name = field(body, "base_model", str)
    except (NotFound, Refused) as exc:
        raise refused(exc) from None
    sampler = await open_sampler(request, session, seq, target(request, scenario_name, point))
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler.id})


def _sampler(request: web.Request, sampler_id: str) -> Sampler:
    tinker = tinker_of(request)
    try:
        sampler = tinker.samplers.get(sampler_id)
        tinker.session(sampler.session, owner(request))
    except (KeyError, NotFound):
        raise ApiError(404, f"no sampling session {sampler_id!r} open for this token", code="not_found") from None
    return sampler


async def get_sampler(request: web.Request) -> web.Response:
    sampler = _sampler(request, request.match_info["sampler_id"])
    return web.json_response({"sampler_id": sampler.id, "base_model": sampler.scenario,
                              "model_path": sampler.model_path})


def _token_sample(body: dict[str, Any], adapter: str | None) -> TokenSample:
    params = field(body, "sampling_params", dict, {})
    chunks = field(field(body, "prompt", dict), "chunks", list)
    prompt: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise ApiError(400, "prompt.chunks: reefd samples from text (encoded_text chunks)", param="prompt",
                           code="invalid_request")
        prompt.extend(field(chunk, "tokens", list))
    n = field(body, "num_samples", int, 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise ApiError(400, f"num_samples: 1 to {MAX_SAMPLES}", param="num_samples", code="invalid_request")
    try:
        top_k = params.get("top_k")
        req = TokenSample(prompt, int(params.get("max_tokens") or 256), n, float(params.get("temperature", 1.0)),
                          float(params.get("top_p", 1.0)), None if top_k in (None, -1) else int(top_k),
                          params.get("seed"), stop_of(params.get("stop")), bool(body.get("prompt_logprobs")),
                          adapter)
        req.check()
    except (TypeError, ValueError, Refused, EngineError) as exc:
        raise ApiError(400, f"sampling_params: {exc}", param="sampling_params", code="invalid_request") from None
    return req


async def asample(request: web.Request) -> web.Response:
    body = await body_of(request)
    sampler = _sampler(request, field(body, "sampling_session_id", str))
    seq = field(body, "seq_id", int)
    if (earlier := sampler.taken.get(seq)) is not None:  # sent again after a timeout: the same request
        request_id, receipts = earlier
        return web.json_response({"request_id": request_id, "sample_sequence_ids": receipts})
    req = _token_sample(body, sampler.adapter)
    receipts = [new_receipt() for _ in range(req.n)]
    records = request.app[RECORDS]

    async def write(record: dict[str, Any]) -> None:
        await records.put_record(record)

    tinker = tinker_of(request)
    request_id = tinker.futures.submit(sample_work(tinker.samplers, sampler, req, receipts, write)(), "sample")
    sampler.taken[seq] = (request_id, receipts)
    return web.json_response({"request_id": request_id, "sample_sequence_ids": receipts})
