"""SGLangEngine against scripted `/generate` answers: what a real SGLang server may send.

Contract test: real SGLang needs a GPU. The scripted server replays SGLang's documented
shapes (cumulative chunks by default, incremental with --incremental-streaming-output,
Hermes tool-call text, stop-string finish reasons); the worker covers the rest end to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from reefd.engines import EngineUnavailable, ModelConfig, Prompt
from reefd.engines.sglang import SGLangEngine
from reefd.serve.chat import ChatRequest, Completion

pytestmark = pytest.mark.contract

TOOL_TEXT = 'Checking.<tool_call>{"name": "ls", "arguments": {"dir": "/"}}</tool_call>'


def steps(text: str, ids: list[int], finish: dict[str, Any], incremental: bool
          ) -> list[dict[str, Any]]:
    """SGLang stream chunks for `text` split in three, cumulative or incremental."""
    cuts = [len(text) // 3, 2 * len(text) // 3, len(text)]
    icuts = [len(ids) // 3, 2 * len(ids) // 3, len(ids)]
    out, prev_t, prev_i = [], 0, 0
    for k, (c, ic) in enumerate(zip(cuts, icuts, strict=True)):
        last = k == 2
        lps = [[-0.5, t, None] for t in ids[:ic]]
        chunk_ids, chunk_text, chunk_lps = ids[:ic], text[:c], lps
        if incremental:
            chunk_ids, chunk_text, chunk_lps = ids[prev_i:ic], text[prev_t:c], lps[prev_i:]
        out.append({"text": chunk_text, "output_ids": chunk_ids, "meta_info": {
            "id": "r", "finish_reason": finish if last else None, "prompt_tokens": 5,
            "completion_tokens": ic, "output_token_logprobs": chunk_lps}})
        prev_t, prev_i = c, ic
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(script: list[dict[str, Any]], answer: Handler | None = None
                ) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """A scripted SGLang server: `script`'s chunks, or `answer` for every /generate."""
    seen: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if not body["stream"]:
            return web.json_response(script[-1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in script:
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/generate", answer or generate)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


async def run(tiny_dir: Path, script: list[dict[str, Any]], req: ChatRequest, stream: bool
              ) -> tuple[list[Any], list[dict[str, Any]]]:
    runner, url, seen = await serve(script)
    try:
        async with aiohttp.ClientSession() as session:
            cfg = ModelConfig(name="t", engine="sglang", url=url, path=str(tiny_dir))
            engine = SGLangEngine(cfg, tiny_dir, session)
            await engine.start()
            for _ in range(100):
                if engine.ready:
                    break
                await asyncio.sleep(0.05)
            events = [e async for e in engine.generate(req, stream=stream)]
            await engine.stop()
            return events, seen
    finally:
        await runner.cleanup()


@pytest.fixture
def tiny(tiny_model: Path) -> Path:
    return tiny_model


TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("incremental", [False, True])
def test_tool_call_stream_in_either_chunk_style(tiny: Path, incremental: bool) -> None:
    ids = list(range(10, 30))
    script = steps(TOOL_TEXT, ids, {"type": "stop", "matched": 2}, incremental)
    req = ChatRequest(messages=[{"role": "user", "content": "ls"}], max_tokens=64, tools=TOOLS)
    events, seen = asyncio.run(run(tiny, script, req, stream=True))
    assert isinstance(events[0], Prompt) and events[0].tokens == len(seen[0]["input_ids"])
    deltas = "".join(e for e in events if isinstance(e, str))
    done = events[-1]
    assert isinstance(done, Completion)
    assert deltas == "Checking."  # the markup never reaches the client
    assert done.finish_reason == "tool_calls" and done.text == "Checking."
    assert json.loads(done.tool_calls[0]["function"]["arguments"]) == {"dir": "/"}
    assert done.completion_token_ids == ids and done.completion_logprobs == [-0.5] * 20
    assert seen[0]["return_logprob"] is True and seen[0]["sampling_params"]["max_new_tokens"] == 64


def test_non_streaming_stop_string_is_reported(tiny: Path) -> None:
    script = steps("Hello there", [5, 6, 7], {"type": "stop", "matched": "###"}, False)
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=8, stop=["###"],
                      temperature=0.0, seed=4)
    events, seen = asyncio.run(run(tiny, script, req, stream=False))
    done = events[-1]
    assert isinstance(done, Completion)
    assert (done.text, done.finish_reason, done.stop_sequence) == ("Hello there", "stop", "###")
    params = seen[0]["sampling_params"]
    assert params["stop"] == ["###"] and params["temperature"] == 0.0 and params["sampling_seed"] == 4


def test_tools_not_offered_means_markup_is_plain_text(tiny: Path) -> None:
    script = steps(TOOL_TEXT, [1, 2, 3], {"type": "length", "length": 3}, False)
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=3)
    events, _ = asyncio.run(run(tiny, script, req, stream=True))
    done = events[-1]
    assert done.tool_calls == [] and done.text == TOOL_TEXT and done.finish_reason == "length"
    assert "".join(e for e in events if isinstance(e, str)) == TOOL_TEXT


def test_unready_engine_refuses_before_any_event(tmp_path: Path) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            engine = SGLangEngine(ModelConfig(name="t", engine="worker", path=str(tmp_path)),
                                  tmp_path, session)
            with pytest.raises(EngineUnavailable):
                await anext(engine.generate(ChatRequest(messages=[], max_tokens=1)))

    asyncio.run(go())


def test_an_attached_server_that_goes_away_is_reported(tiny: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from reefd.engines.supervisor import Supervisor

    monkeypatch.setattr(Supervisor, "HEALTH_INTERVAL_S", 0.05)

    async def go() -> None:
        runner, url, _ = await serve([])
        async with aiohttp.ClientSession() as session:
            engine = SGLangEngine(ModelConfig(name="t", engine="sglang", url=url, path=str(tiny)),
                                  tiny, session)
            await engine.start()
            for _ in range(200):
                if engine.ready:
                    break
                await asyncio.sleep(0.02)
            assert engine.ready
            await runner.cleanup()  # the server we attached to is gone
            for _ in range(200):
                if engine.state == "unreachable":
                    break
                await asyncio.sleep(0.02)
            assert engine.state == "unreachable" and not engine.ready
            await engine.stop()

    asyncio.run(go())


def test_an_event_of_any_size_is_read(tiny: Path) -> None:
    """SGLang's default stream repeats the whole answer on every event: a long answer makes lines past aiohttp's
    line limit (about 11.8k tokens of ids and logprobs), which used to end the stream with a 500 and no record."""
    ids = [7 + i % 100 for i in range(30_000)]  # about 0.7 MB of ids and logprobs in the last event
    text = "x" * 30_000
    script = steps(text, ids, {"type": "length", "length": 30_000}, incremental=False)
    assert len(json.dumps(script[-1])) > 512 << 10
    req = ChatRequest(messages=[{"role": "user", "content": "go"}], max_tokens=30_000)
    events, _ = asyncio.run(run(tiny, script, req, stream=True))
    done = events[-1]
    assert isinstance(done, Completion)
    assert "".join(e for e in events if isinstance(e, str)) == text == done.text
    assert done.completion_token_ids == ids and done.finish_reason == "length"


def test_a_malformed_event_is_an_engine_error(tiny: Path) -> None:
    from reefd.engines import EngineError

    async def malformed(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}
        await resp.write(b"data: " + json.dumps(first).encode() + b"\n\ndata: {not json\n\n")
        return resp

    async def main() -> None:
        runner, url, _ = await serve([], malformed)
        try:
            async with aiohttp.ClientSession() as session:
                engine = SGLangEngine(ModelConfig(name="t", engine="sglang", url=url, path=str(tiny)), tiny, session)
                await engine.start()
                for _ in range(100):
                    if engine.ready:
                        break
                    await asyncio.sleep(0.05)
                req = ChatRequest(messages=[{"role": "user", "content": "go"}], max_tokens=8)
                with pytest.raises(EngineError, match="could not be read"):
                    _ = [e async for e in engine.generate(req, stream=True)]
                await engine.stop()
        finally:
            await runner.cleanup()

    asyncio.run(main())
