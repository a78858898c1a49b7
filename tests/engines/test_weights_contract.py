"""SGLang's weight-update contract, against scripted servers that answer as SGLang documents it.

Contract test: real SGLang needs a GPU. `update_weights_from_disk` must send SGLang's UpdateWeightFromDiskReqInput
(`model_path`, `weight_version` = the release id, `abort_all_requests: false`) and read its
`{success, message, num_paused_requests}` answer (HTTP 400 with `success: false` on failure). And an answer whose
`meta_info.weight_version` is not the weights the request was taken on (a router that picked a replica which had
just switched) is dropped and sent again to a replica that still has them. The worker covers the same end to end
(tests/e2e/test_weights.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from reefd.engines import EngineError, EngineUnavailable, ModelConfig
from reefd.engines.replicas import Replica
from reefd.engines.sglang import SGLangEngine
from reefd.engines.sglang_client import SGLangClient
from reefd.serve.chat import ChatRequest, Completion

pytestmark = pytest.mark.contract


async def server(version: str | None, seen: list[tuple[str, dict[str, Any]]], fail: str | None = None
                 ) -> tuple[web.AppRunner, str]:
    """An SGLang-like server whose answers report `version` as their weight_version."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(("generate", body))
        chunk = {"text": "hi", "output_ids": [5], "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "stop"}, "prompt_tokens": 3, "completion_tokens": 1,
            "output_token_logprobs": [[-0.1, 5, None]], "weight_version": version}}
        if not body["stream"]:
            return web.json_response(chunk)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(("update_weights_from_disk", body))
        if fail:
            return web.json_response({"success": False, "message": fail, "num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/update_weights_from_disk", update)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_sglangs_default_version_is_the_launch_weights(tiny_model: Path) -> None:
    """SGLang names the weights it launched with "default": a request on them is answered there, not re-sent."""
    async def go() -> tuple[list[Any], list[Any]]:
        at_router: list[tuple[str, dict[str, Any]]] = []
        router, router_url = await server("default", at_router)
        try:
            async with aiohttp.ClientSession() as session:
                engine = SGLangEngine(ModelConfig(name="t", path=str(tiny_model)), tiny_model, session)
                engine._load_template(tiny_model)
                engine.replicas = Routed(router_url, [])  # type: ignore[assignment]
                req = ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=1)
                return [e async for e in engine.generate(req, stream=False, weights=None)], at_router
        finally:
            await router.cleanup()

    events, at_router = asyncio.run(go())
    assert isinstance(events[-1], Completion) and len(at_router) == 1


def test_update_weights_from_disk_sends_sglangs_request(tmp_path: Path) -> None:
    async def go() -> list[tuple[str, dict[str, Any]]]:
        seen: list[tuple[str, dict[str, Any]]] = []
        runner, url = await server(None, seen)
        bad_runner, bad_url = await server(None, seen, fail="model_path has no safetensors")
        try:
            async with aiohttp.ClientSession() as session:
                await SGLangClient(session, url).update_weights_from_disk(tmp_path, "r4-abcdef0")
                await SGLangClient(session, url).update_weights_from_disk(tmp_path, None)  # back to the launch
                with pytest.raises(EngineError, match="model_path has no safetensors") as e:
                    await SGLangClient(session, bad_url).update_weights_from_disk(tmp_path, "r5-abcdef0")
                assert e.value.status == 400
        finally:
            await runner.cleanup()
            await bad_runner.cleanup()
        return seen

    seen = asyncio.run(go())
    assert seen[0] == ("update_weights_from_disk", {"model_path": str(tmp_path), "abort_all_requests": False,
                                                    "weight_version": "r4-abcdef0"})
    assert seen[1][1]["weight_version"] == "default"  # SGLang keeps its old version when none is sent


class Routed:
    """What SGLangEngine needs of its replicas for routing: the router's URL and each replica's weights."""

    def __init__(self, router: str, replicas: list[Replica]) -> None:
        self.router_url, self.replicas, self.ready, self.state = router, replicas, True, "ready"


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_from_other_weights_is_sent_again_where_its_weights_serve(tiny_model: Path, stream: bool) -> None:
    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        at_router: list[tuple[str, dict[str, Any]]] = []
        at_old: list[tuple[str, dict[str, Any]]] = []
        router, router_url = await server("r2-new0000", at_router)  # the router picked an updated replica
        old, old_url = await server("r1-old0000", at_old)  # a replica that still has the request's weights
        try:
            async with aiohttp.ClientSession() as session:
                engine = SGLangEngine(ModelConfig(name="t", path=str(tiny_model)), tiny_model, session)
                engine._load_template(tiny_model)
                engine.replicas = Routed(router_url, [  # type: ignore[assignment]
                    Replica(0, url=old_url, state="draining", weights="r1-old0000"),
                    Replica(1, url="http://127.0.0.1:9", state="ready", weights="r2-new0000")])
                engine.weights = type(engine.weights)("r1-old0000")  # before the switch: the router serves r1
                req = ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=1)
                events = [e async for e in engine.generate(req, stream=stream, weights="r1-old0000")]
                assert engine.replicas.replicas[0].direct == 0
                with pytest.raises(EngineUnavailable, match="no longer serve"):  # nowhere left with r0's weights
                    await anext(engine.generate(req, stream=stream, weights="r0-gone000"))
                return events, at_router, at_old
        finally:
            await router.cleanup()
            await old.cleanup()

    events, at_router, at_old = asyncio.run(go())
    completion = events[-1]
    assert isinstance(completion, Completion) and completion.weight_version == "r1-old0000"
    assert completion.weights_reported
    assert len(at_router) == 1 and len(at_old) == 1
    assert at_old[0][1]["rid"] != at_router[0][1]["rid"]  # sent again as a new request
