"""The Tinker API's routes, each declared once: its method, path, handler, token scope, and what the OpenAPI
document says of it (its request body's schema, its answer's, its error statuses). app.py adds them and takes
their scopes from here, api/openapi.py describes them from here; the SDK calls them under its base URL's
/api/v1/. The answers' schemas are the SDK's response types, loosely (extra keys may appear)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from reefd.api import tinker_sample, tinker_sessions, tinker_state, tinker_train
from reefd.ops.auth import ANY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROTOBUF = "application/x-protobuf"


def obj(required: str = "", **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required.split(), "properties": props}


STR, INT, BOOL, NUM = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}
FUTURE = obj("request_id", request_id=STR, model_id={"type": ["string", "null"]})
MODEL_CALL = obj("model_id seq_id", model_id=STR, seq_id=INT)
SAVE = obj("model_id seq_id path", model_id=STR, seq_id=INT, path=STR, overwrite=BOOL)
RESULT = {"oneOf": [obj("type request_id", type={"const": "try_again"}, request_id=STR, queue_state=STR),
                    obj("error category", error=STR, category={"enum": ["unknown", "server", "user"]}),
                    {"type": "object", "not": {"anyOf": [{"required": ["error"]},
                                                         {"required": ["type"], "properties": {
                                                             "type": {"const": "try_again"}}}]}}]}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    scope: str
    op_id: str
    summary: str
    body: dict[str, Any] | None  # the JSON request body's schema (None: none, or protobuf)
    answer: dict[str, Any]
    errors: tuple[int, ...] = (400, 404)
    protobuf_body: bool = False  # the body is a protobuf message
    protobuf_answer: bool = False  # a success may be protobuf (ForwardBackwardOutput, SampleResponse)


ROUTES: list[Route] = [
    Route("POST", "/api/v1/client/config", tinker_sessions.client_config, "train", "tinkerClientConfig",
          "The SDK's client settings (plain HTTP, API-key auth, uncompressed requests)",
          obj(sdk_version=STR), obj(), (501,)),
    Route("POST", "/api/v1/client/dynamic_config", tinker_sessions.dynamic_config, "train", "tinkerDynamicConfig",
          "The SDK's refreshed settings", obj(sdk_version=STR), obj(), ()),
    Route("POST", "/api/v1/create_session", tinker_sessions.create_session, "train", "tinkerCreateSession",
          "Open a training session (kept by a heartbeat)", obj(tags={"type": "array", "items": STR},
                                                              user_metadata=obj()),
          obj("session_id", session_id=STR), (400, 429, 501)),
    Route("POST", "/api/v1/session_heartbeat", tinker_sessions.heartbeat, "train", "tinkerHeartbeat",
          "Keep a session open (410 once it ended)", obj("session_id", session_id=STR), obj(), (400, 410, 501)),
    Route("POST", "/api/v1/sessions/{session_id}/finish", tinker_sessions.finish_session, "train",
          "tinkerFinishSession",
          "End a session: its models' trainers stop (their checkpoints stay)", None, obj(), (404, 501)),
    Route("POST", "/api/v1/telemetry", tinker_sessions.telemetry, "train", "tinkerTelemetry",
          "The SDK's telemetry (accepted, and kept nowhere)", None, obj("status", status={"const": "accepted"}),
          ()),
    Route("GET", "/api/v1/healthz", tinker_sessions.healthz, ANY, "tinkerHealthz", "Liveness, for the SDK", None,
          obj("status", status={"const": "ok"}), ()),
    Route("GET", "/api/v1/get_server_capabilities", tinker_sessions.capabilities, "train", "tinkerCapabilities",
          "The scenarios a model can be trained on (base_model names the scenario)", None,
          obj("supported_models", supported_models={"type": "array", "items": obj(model_name=STR)}), ()),
    Route("POST", "/api/v1/create_model", tinker_train.create_model, "train", "tinkerCreateModel",
          "A LoRA on a scenario's base model, in a trainer of its own (a future)",
          obj("session_id model_seq_id base_model", session_id=STR, model_seq_id=INT, base_model=STR,
              lora_config=obj(rank=INT, train_attn=BOOL, train_mlp=BOOL, seed=INT)),
          FUTURE, (400, 404, 429, 501, 503)),
    Route("POST", "/api/v1/get_info", tinker_train.get_info, "train", "tinkerGetInfo",
          "A model: its scenario, rank and tokenizer folder", obj("model_id", model_id=STR),
          obj("model_id model_data", model_id=STR, model_data=obj()), (400, 404, 501)),
    Route("POST", "/api/v1/forward_backward", tinker_train.forward_backward, "train", "tinkerForwardBackward",
          "A forward pass and its loss's gradient, added up until optim_step (forward_only: no gradient)", None,
          FUTURE, (400, 404, 501), protobuf_body=True),
    Route("POST", "/api/v1/optim_step", tinker_train.optim_step, "train", "tinkerOptimStep",
          "An AdamW step on the gradient added up since the last one (a future)",
          {**MODEL_CALL, "required": ["model_id", "seq_id", "adam_params"],
           "properties": {**MODEL_CALL["properties"], "adam_params": obj("learning_rate", learning_rate=NUM)}},
          FUTURE),
    Route("POST", "/api/v1/save_weights", tinker_state.save_weights, "train", "tinkerSaveWeights",
          "Save the training state (LoRA and optimizer) as tinker://RUN/weights/NAME (a future)", SAVE, FUTURE),
    Route("POST", "/api/v1/save_weights_for_sampler", tinker_state.save_weights_for_sampler, "train",
          "tinkerSaveWeightsForSampler", "Save the LoRA as tinker://RUN/sampler_weights/NAME (a future)", SAVE,
          FUTURE),
    Route("POST", "/api/v1/load_weights", tinker_state.load_weights, "train", "tinkerLoadWeights",
          "Load a checkpoint into a model, or into a new one (session_id, model_seq_id) (a future)",
          obj("path", path=STR, model_id=STR, seq_id=INT, session_id=STR, model_seq_id=INT, optimizer=BOOL),
          FUTURE, (400, 404, 429, 501, 503)),
    Route("POST", "/api/v1/create_sampling_session", tinker_sample.create_sampling_session, "train",
          "tinkerCreateSamplingSession", "Sample a scenario's base model, or a checkpoint (loaded into its engine)",
          obj("session_id sampling_session_seq_id", session_id=STR, sampling_session_seq_id=INT, model_path=STR,
              base_model=STR), obj("sampling_session_id", sampling_session_id=STR), (400, 404, 501, 502, 503)),
    Route("GET", "/api/v1/samplers/{sampler_id}", tinker_sample.get_sampler, "train", "tinkerGetSampler",
          "A sampling session: its scenario and checkpoint", None,
          obj("sampler_id base_model", sampler_id=STR, base_model=STR, model_path={"type": ["string", "null"]}),
          (404, 501)),
    Route("POST", "/api/v1/asample", tinker_sample.asample, "train", "tinkerSample",
          "Samples from token ids through the scenario's engine, each a record whose receipt is its sequence id "
          "(a future)", obj("sampling_session_id seq_id prompt", sampling_session_id=STR, seq_id=INT,
                             num_samples=INT, prompt=obj("chunks", chunks={"type": "array"}),
                             sampling_params=obj()),
          obj("request_id sample_sequence_ids", request_id=STR,
              sample_sequence_ids={"type": "array", "items": STR}), (400, 404, 501)),
    Route("POST", "/api/v1/retrieve_future", tinker_state.retrieve_future, "train", "tinkerRetrieveFuture",
          "A future's result, waited for up to 20 s: the result, its failure, or try_again",
          obj("request_id", request_id=STR), RESULT, (400, 404, 501), protobuf_answer=True),
]
SCOPES: dict[Callable[..., object], str] = {r.handler: r.scope for r in ROUTES}


def add(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, route.path, route.handler)
