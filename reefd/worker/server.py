"""The worker's aiohttp app: SGLang's `/generate`, health and info routes (the wire shapes).

Owns the SGLang response bodies (`text`, `output_ids`, `meta_info`). Knows nothing about
torch: requests go to the batcher as token ids and come back as `Update`s.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

from aiohttp import web

from reefd.worker import openai_chat
from reefd.worker.generation import Generation, Update
from reefd.worker.params import SHIFT_NATS, BadRequest, GenerateRequest, SamplingParams, parse_generate
from reefd.worker.weight_sync import WeightGroup, parse_update
from reefd.worker.wire import (
    STATE,
    WorkerState,
    close_sse,
    error_response,
    errors_middleware,
    open_sse,
    read_json,
    send_sse,
    updates,
)


class Result:
    """One job's SGLang answer: whole, or streamed as SGLang streams it.

    By default each streamed event repeats the whole answer so far, as SGLang does; with
    `--incremental-streaming-output` each event carries only what is new (ids, text and output
    logprobs), so an event costs O(new tokens) however long the answer grows.
    """

    def __init__(self, job: Generation, weight_version: Any = None, shift: float = 0.0) -> None:
        self.job = job
        self.shift = shift  # a test fault's (shift-logprobs): every logprob is reported this far off
        self.weight_version = weight_version  # what the job runs on: updates wait for running jobs
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[list[Any]]] = []
        self._text: list[str] = []
        self.finish: dict[str, Any] | None = None
        self.input_logprobs: list[list[Any]] | None = None
        self.input_top_logprobs: list[list[list[Any]] | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self._text)

    def add(self, update: Update) -> None:
        self.ids += update.new_ids
        self.logprobs += update.new_logprobs
        self.top_logprobs += update.new_top_logprobs
        if update.new_text:
            self._text.append(update.new_text)
        self.finish = update.finish
        if update.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = update.input_logprobs, update.input_top_logprobs

    def body(self, new: Update | None = None) -> dict[str, Any]:
        """The answer so far, or with `new` (the update just added) only what it brought."""
        req = self.job.req
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": self.finish, "prompt_tokens": len(self.job.prompt),
            "completion_tokens": len(self.ids), "cached_tokens": 0,
            "e2e_latency": round(time.monotonic() - self.job.created, 6), "weight_version": self.weight_version}
        ids, logprobs, tops = (self.ids, self.logprobs, self.top_logprobs) if new is None else (
            new.new_ids, new.new_logprobs, new.new_top_logprobs)
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)]
            if req.top_logprobs_num > 0:  # [[[logprob, token_id, None] x K] per output token], best first
                meta["output_top_logprobs"] = list(tops)
            if req.logprob_start_len >= 0:  # SGLang's: from logprob_start_len, its own entry without a logprob
                meta["input_token_logprobs"] = self.input_logprobs or []
                if req.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = self.input_top_logprobs or []
        text = self.text if new is None else new.new_text
        return {"text": text, "output_ids": list(ids), "meta_info": _shifted(meta, self.shift) if self.shift else meta}


def _shifted(meta: dict[str, Any], by: float) -> dict[str, Any]:
    """`meta` with every logprob in it moved by `by` (a test fault)."""
    def entries(rows: list[list[Any]]) -> list[list[Any]]:
        return [[None if lp is None else lp + by, *rest] for lp, *rest in rows]

    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in meta:
            meta[key] = entries(meta[key])
    for key in ("output_top_logprobs", "input_top_logprobs"):
        if key in meta:
            meta[key] = [None if row is None else entries(row) for row in meta[key]]
    return meta


WEIGHT_GROUP = web.AppKey("reefd_worker_weight_group", WeightGroup)


def aborted(result: Result) -> bool:
    return bool(result.finish and result.finish.get("type") == "abort")


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_generate(await read_json(request))
    prompt = req.input_ids if req.input_ids is not None else list(state.tokenizer.encode(req.text))
    await state.admit()
    job = state.batcher.submit(req, prompt)
    result = Result(job, shift=SHIFT_NATS if req.lora_path in state.batcher.engine.shifted else 0.0)
    response = await open_sse(request) if req.stream else None
    async with aclosing(updates(job)) as stream:
        async for update in stream:
            result.weight_version = state.batcher.engine.weight_version
            result.add(update)
            if response is not None:
                await send_sse(response, result.body(update if state.incremental else None))
    if response is not None:
        return await close_sse(response)
    if aborted(result):
        return error_response(503, str(result.finish and result.finish.get("message")), "server_error")
    return web.json_response(result.body())


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """200 only after the model really produced one token."""
    state = request.app[STATE]
    engine = state.batcher.engine
    req = GenerateRequest(input_ids=[engine.pad_id], text=None,
                          sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    try:
        job = state.batcher.submit(req, [engine.pad_id])
        async with asyncio.timeout(60), aclosing(updates(job)) as stream:
            async for update in stream:
                if update.finish and update.finish.get("type") == "length" and len(update.new_ids) == 1:
                    return web.Response(status=200)
    except (RuntimeError, TimeoutError) as exc:
        return error_response(503, f"generation failed: {exc}", "server_error")
    return error_response(503, "generation did not produce a token", "server_error")


def server_info_body(state: WorkerState) -> dict[str, Any]:
    batcher = state.batcher
    engine = batcher.engine
    return {
        "model_path": state.model_path, "tokenizer_path": state.model_path,
        "served_model_name": state.served_model_name, "max_batch": batcher.max_batch,
        "max_running_requests": batcher.max_batch, "context_length": engine.context_length,
        "device": str(engine.device), "dtype": "float32", "version": state.version, "engine": "reefd.worker",
        "uptime_s": round(time.time() - state.started, 3), "running_requests": batcher.running,
        "waiting_requests": batcher.busy - batcher.running, "stats": batcher.stats.as_dict(),
        "loaded_adapters": dict(engine.adapters), "lora_paths": dict(engine.adapters),
        "weight_version": engine.weight_version,
        # SGLang ServerArgs a trainer reads before it pushes weights (slime's external engines): one process,
        # one device, no memory saver, no prefill/decode split
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "enable_memory_saver": False,
        "disaggregation_mode": "null", "is_paused": not state.running.is_set(),
        "incremental_streaming_output": state.incremental,
    }


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info_body(request.app[STATE]))


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
        "served_model_name": state.served_model_name,
        "context_length": state.batcher.engine.context_length,  # not in SGLang's; see /server_info
    })


def _name(body: Any, key: str) -> str:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key} must be a non-empty string")
    return value


def _lora_answer(state: WorkerState, error: str | None) -> web.Response:
    """SGLang's LoRAUpdateOutput: {success, error_message, loaded_adapters}."""
    body = {"success": error is None, "error_message": error, "loaded_adapters": dict(state.batcher.engine.adapters)}
    return web.json_response(body, status=200 if error is None else 400)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Load a PEFT LoRA folder under `lora_name`, between decode steps (running requests go on)."""
    state = request.app[STATE]
    batcher = state.batcher
    try:
        body = await read_json(request)
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        await batcher.control(lambda: batcher.engine.load_adapter(name, Path(path)))
    except BadRequest as exc:
        return _lora_answer(state, str(exc))
    return _lora_answer(state, None)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Unload `lora_name`. As SGLang: new requests for it are refused at once, and the unload
    itself waits until the running and queued requests that use it have finished."""
    state = request.app[STATE]
    batcher = state.batcher
    try:
        name = _name(await read_json(request), "lora_name")
        if name not in batcher.engine.adapters or name in batcher.unloading:
            raise BadRequest(f"no adapter named {name!r} is loaded")
        batcher.unloading.add(name)
        try:
            await batcher.control(lambda: batcher.engine.unload_adapter(name),
                                  ready=lambda: not batcher.uses_adapter(name))
        finally:
            batcher.unloading.discard(name)
    except BadRequest as exc:
        return _lora_answer(state, str(exc))
    return _lora_answer(state, None)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """SGLang's UpdateWeightFromDiskReqInput -> {success, message, num_paused_requests}.

    The folder is read off the batcher thread; the copy waits (as SGLang's writer lock) until
    the running requests finish, admitting no new ones meanwhile, or aborts them first with
    `abort_all_requests`. A bad folder changes nothing.
    """
    state = request.app[STATE]
    batcher = state.batcher
    engine = batcher.engine
    try:
        body = await read_json(request)
        path = Path(_name(body, "model_path"))
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {load_format!r} is not supported (auto or safetensors)")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string")
        weights = await asyncio.to_thread(engine.read_weights, path)
        if body.get("abort_all_requests") is True:
            batcher.abort_running("aborted for a weight update")
        await batcher.control(lambda: engine.apply_weights(weights, path, version), ready=lambda: not batcher.rows,
                              exclusive=True)
    except BadRequest as exc:
        return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
    state.model_path = str(path)
    return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                              "num_paused_requests": 0})


def _weights_answer(error: str | None, status: int = 400) -> web.Response:
    """SGLang's weight-update answers: {success, message}."""
    if error is None:
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})
    return web.json_response({"success": False, "message": error}, status=status)


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight update group (InitWeightsUpdateGroupReqInput); blocks until the group forms."""
    group = request.app[WEIGHT_GROUP]
    try:
        body = await read_json(request)
        address = _name(body, "master_address")  # BadRequest unless the body is an object
        numbers: list[int] = []
        for key in ("master_port", "rank_offset", "world_size"):
            value = body.get(key, 1 if key == "rank_offset" else None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadRequest(f"{key} must be an integer")
            numbers.append(value)
        port, offset, world = numbers
        await asyncio.to_thread(group.join, address, port, offset, world,
                                str(body.get("group_name", "weight_update_group")), str(body.get("backend", "nccl")))
    except BadRequest as exc:
        return _weights_answer(str(exc))
    return web.json_response({"success": True, "message": "Succeeded to initialize the weight update group."})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Receive the named tensors from the trainer (rank 0), then apply them between decode steps once the running
    requests have finished (UpdateWeightsFromDistributedReqInput, with `weight_version`)."""
    state, group = request.app[STATE], request.app[WEIGHT_GROUP]
    batcher, engine = state.batcher, state.batcher.engine
    try:
        body = await read_json(request)
        name, names, dtypes, shapes = parse_update(body)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string")
        weights = await asyncio.to_thread(group.receive, name, names, dtypes, shapes)
        await batcher.control(lambda: engine.apply_weights(weights, None, version, partial=True),
                              ready=lambda: not batcher.rows, exclusive=True)
    except BadRequest as exc:
        return _weights_answer(str(exc))
    return _weights_answer(None)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    group = request.app[WEIGHT_GROUP]
    try:
        body = await read_json(request)
        name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise BadRequest("group_name must be a string")
        await asyncio.to_thread(group.leave, name)
    except BadRequest as exc:
        return _weights_answer(str(exc))
    return web.json_response({"success": True, "message": "Succeeded to destroy the weight update group."})


PAUSE_MODES = ("abort", "retract", "in_place")


async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's PauseGenerationReqInput (`mode`, default abort): new requests wait until /continue_generation.
    abort ends the running ones (as `abort`); retract and in_place let them finish (the worker has no KV cache to
    retract or keep)."""
    state = request.app[STATE]
    body = await read_json(request) if request.can_read_body else {}
    mode = body.get("mode", "abort") if isinstance(body, dict) else None
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}")
    state.running.clear()
    if mode == "abort":
        state.batcher.abort_running("aborted by pause_generation")
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].running.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache (GET or POST): 200 when idle, 400 while requests run or wait. The worker keeps no
    prefix cache, so there is nothing else to drop."""
    if request.app[STATE].batcher.busy:
        return web.Response(status=400, text="Flush cache failed.\n")
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n")


async def weight_version(request: web.Request) -> web.Response:
    """SGLang's GetWeightsVersion answer."""
    return web.json_response({"weight_version": request.app[STATE].batcher.engine.weight_version})


def build_app(state: WorkerState) -> web.Application:
    """The worker's routes over one batcher."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app[WEIGHT_GROUP] = WeightGroup(state.batcher.engine.device)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/v1/chat/completions", openai_chat.chat_completions)
    app.router.add_get("/v1/models", openai_chat.models)
    return app
