"""SamplesTokens, sampling from a prompt of the engine's own token ids (the Tinker API's `sample`).

Its declaration (read once where a Scenario is built: the SGLang-contract and vLLM engines have it, upstream does
not), the request's own refusals, and the engine's before any process is reached. Then the contract, run for real
on the tiny model against each engine that runs here, the embedded worker and vLLM's CPU build: the engine object
is built in this process (reefd's HTTP API has no route to it) and launches its process once per kind, with one
LoRA adapter loaded. Greedy samples are what a teacher-forced pass of the same ids (the release proof's
`teacher_forced`) says, on the base and on the adapter, which answers otherwise; max_tokens and a stop id end a
sample as they say; n seeded samples repeat; the prompt's logprobs are one per position; a token id outside the
vocabulary is a 400."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import pytest

from reefd.engines import (
    EngineError,
    EngineUnavailable,
    ModelConfig,
    SampledSequence,
    SamplesTokens,
    TokenSample,
    TokenSamples,
    build_engine,
)
from reefd.engines.replicas import Replica
from reefd.engines.sglang import SGLangEngine, WorkerEngine
from reefd.engines.token_sampling import completions_body, generate_payload
from reefd.engines.upstream import UpstreamEngine
from reefd.engines.vllm import VLLMEngine
from reefd.serve.scenarios import Scenario
from tests.e2e.test_engines import vllm_python
from tests.engines.test_sglang_client import serve
from tests.engines.test_weights_contract import Routed
from tests.loras import make_lora

T = TypeVar("T")
TOL = 1e-3  # a greedy sample's logprobs against a teacher-forced pass of its ids, on the same process
PROMPT = "The cat sat on the"


def scenario(engine: Any) -> Scenario:
    return Scenario(cfg=SimpleNamespace(name="s"), engine=engine)  # type: ignore[arg-type]


def test_the_ability_is_declared_by_the_engines_that_have_it(tmp_path: Path) -> None:
    for kind, cls in (("worker", WorkerEngine), ("sglang", SGLangEngine), ("vllm", VLLMEngine)):
        engine = cls(ModelConfig(name="t", engine=kind, path=str(tmp_path)), tmp_path, None)  # type: ignore[arg-type]
        assert scenario(engine).samples_tokens is engine
    upstream = UpstreamEngine(ModelConfig(name="u", engine="upstream", url="http://127.0.0.1:9"), tmp_path,
                              None)  # type: ignore[arg-type]
    assert not isinstance(upstream, SamplesTokens) and scenario(upstream).samples_tokens is None


@pytest.mark.parametrize(("fields", "problem"), [
    ({"prompt": []}, "non-empty list of token ids"), ({"n": 0}, "at least 1"), ({"max_tokens": 0}, "at least 1"),
    ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"stop": ["x", 3]}, "stop must be"),
    ({"stop": [""]}, "stop must be")])
def test_a_request_no_engine_can_take_is_a_400(fields: dict[str, Any], problem: str, tmp_path: Path) -> None:
    """Refused before the engine is asked anything (this one has no process: reaching it would be a 503)."""
    engine = WorkerEngine(ModelConfig(name="t", path=str(tmp_path)), tmp_path, None)  # type: ignore[arg-type]
    req = TokenSample(**{"prompt": [1, 2], "max_tokens": 4, **fields})
    with pytest.raises(EngineError, match=problem) as refused:
        asyncio.run(engine.sample_tokens(req))
    assert refused.value.status == 400


def test_an_adapter_not_loaded_is_a_400_and_an_engine_not_ready_a_503(tmp_path: Path) -> None:
    engine = WorkerEngine(ModelConfig(name="t", path=str(tmp_path)), tmp_path, None)  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="no adapter named 'nope' is loaded") as unknown:
        asyncio.run(engine.sample_tokens(TokenSample([1, 2], 4, adapter="nope")))
    assert unknown.value.status == 400
    with pytest.raises(EngineUnavailable):  # a request it can take, on an engine not ready
        asyncio.run(engine.sample_tokens(TokenSample([1, 2], 4)))


def test_stop_seeds_and_prompt_logprobs_on_the_wire() -> None:
    """None: the end of text only; strings or ids: those too; []: nothing, not even the end of text. Sample i is
    seeded seed + i (as vLLM seeds its n); only SGLang's first request asks the prompt's logprobs."""
    def sglang(**fields: Any) -> list[dict[str, Any]]:
        req = TokenSample(prompt=[5, 6], max_tokens=3, n=2, **fields)
        return [generate_payload(req, 3, i) for i in range(req.n)]

    plain = sglang()[0]
    assert plain["input_ids"] == [5, 6] and plain["return_logprob"] and "logprob_start_len" not in plain
    assert plain["sampling_params"] == {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert sglang(stop=[])[0]["sampling_params"]["ignore_eos"] is True
    assert sglang(stop=["\n"])[0]["sampling_params"]["stop"] == ["\n"]
    assert sglang(stop=[7])[0]["sampling_params"]["stop_token_ids"] == [7]
    assert [p["sampling_params"]["sampling_seed"] for p in sglang(seed=10)] == [10, 11]
    first, second = sglang(prompt_logprobs=True, adapter="a", top_k=4)
    assert first["logprob_start_len"] == 0 and "logprob_start_len" not in second and first["lora_path"] == "a"
    assert first["sampling_params"]["top_k"] == 4

    def vllm(**fields: Any) -> dict[str, Any]:
        return completions_body(TokenSample(prompt=[5, 6], max_tokens=3, n=2, **fields), 3, "base", [2])

    assert vllm()["model"] == "base" and vllm(adapter="a")["model"] == "a" and vllm()["n"] == 2
    assert (vllm()["stop_token_ids"], vllm()["ignore_eos"]) == ([2], False)
    assert (vllm(stop=[])["stop_token_ids"], vllm(stop=[])["ignore_eos"]) == ([], True)
    assert vllm(stop=[7])["stop_token_ids"] == [2, 7] and vllm(stop=["x"])["stop"] == ["x"]
    assert vllm(seed=10)["seed"] == 10 and vllm()["return_tokens_as_token_ids"] is True


@pytest.mark.contract
def test_sglang_samples_go_straight_to_one_replica_serving_the_weights(tiny_model: Path) -> None:
    """Against SGLang's documented /generate answer (scripted servers: real SGLang needs a GPU): behind the router,
    a sample's requests all go to one replica on the serving weights, none through the router (nor to a replica
    on weights on trial), which reads back as the engine's ids, logprobs, stop and prompt logprobs."""
    answer = {"text": "", "output_ids": [7, 8], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 8}, "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
        "input_token_logprobs": [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None]]}}

    async def go() -> tuple[TokenSamples, list[list[dict[str, Any]]], list[int]]:
        servers = [await serve([answer]) for _ in range(3)]
        (_, router_url, at_router), (_, a_url, at_a), (_, b_url, at_b) = servers
        try:
            async with aiohttp.ClientSession() as session:
                engine = SGLangEngine(ModelConfig(name="t", path=str(tiny_model)), tiny_model, session)
                engine._load_template(tiny_model)
                replicas = [Replica(0, url=b_url, state="trial", weights="r9-trial00"),
                            Replica(1, url=a_url, state="ready")]
                engine.replicas = Routed(router_url, replicas)  # type: ignore[assignment]
                got = await engine.sample_tokens(TokenSample([1, 2, 3], 4, n=2, prompt_logprobs=True, seed=3))
                return got, [at_router, at_a, at_b], [r.direct for r in replicas]
        finally:
            for runner, _, _ in servers:
                await runner.cleanup()

    got, (at_router, at_a, at_b), direct = asyncio.run(go())
    assert got == TokenSamples([SampledSequence([7, 8], [-0.5, -0.25], True)] * 2, [None, -1.0, -2.0])
    assert (len(at_router), len(at_a), len(at_b), direct) == (0, 2, 0, [0, 0])
    assert [body["sampling_params"]["sampling_seed"] for body in at_a] == [3, 4]


class Running:
    """An engine started in this process, driven on a loop of its own; `run` runs a coroutine on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Any, kind: str, vocab: int) -> None:
        self.loop, self.engine, self.kind, self.vocab = loop, engine, kind, vocab

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def sample(self, prompt: list[int], max_tokens: int = 8, **fields: Any) -> TokenSamples:
        req = TokenSample(prompt=prompt, max_tokens=max_tokens, **{"temperature": 0.0, **fields})
        return self.run(self.engine.sample_tokens(req, timeout_s=120))

    def forced(self, prompt: list[int], tokens: list[int], adapter: str | None = None) -> list[float | None]:
        """What the proof's teacher-forced pass on the engine's process says of `tokens` after `prompt`."""
        scored = self.run(self.engine._client().teacher_forced(prompt, tokens, adapter))
        assert scored.best == tokens  # greedy: each token is the best one after the ones before it
        return list(scored.logprobs)


async def _started(cfg: ModelConfig, state: Path, adapter: Path) -> tuple[Any, aiohttp.ClientSession]:
    session = aiohttp.ClientSession()
    engine = build_engine(cfg, state, session)
    await engine.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 540
    while not engine.ready:
        if engine.describe()["state"] == "failed" or loop.time() > deadline:
            raise AssertionError(f"the engine did not start: {engine.describe()}")
        await asyncio.sleep(0.2)
    await engine.load_adapter("a", adapter)
    return engine, session


@pytest.fixture(scope="module", params=["worker", "vllm"])
def running(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Running]:
    kind = str(request.param)
    state = tmp_path_factory.mktemp(f"samples-{kind}")
    extra: dict[str, Any] = {"python": vllm_python(), "kv_cache_gib": 1} if kind == "vllm" else {}
    cfg = ModelConfig(name="samples", engine=kind, path=str(tiny_model), **extra)
    adapter = make_lora(tiny_model, state / "lora", seed=1, scale=2.0)
    loop = asyncio.new_event_loop()
    engine, session = loop.run_until_complete(_started(cfg, state, adapter))
    try:
        vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
        yield Running(loop, engine, kind, vocab)
    finally:
        loop.run_until_complete(engine.stop())
        loop.run_until_complete(session.close())
        loop.close()


def prompt(running: Running, text: str = PROMPT) -> list[int]:
    return list(running.engine.template.tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("adapter", [None, "a"])
def test_greedy_samples_are_what_a_teacher_forced_pass_says(running: Running, adapter: str | None) -> None:
    """stop [] (not even the end of text): exactly max_tokens ids, unstopped, each logprob the teacher-forced one;
    the adapter answers otherwise than the base."""
    ids = prompt(running)
    got = running.sample(ids, 8, stop=[], adapter=adapter)
    assert got.prompt_logprobs is None and len(got.samples) == 1
    sample = got.samples[0]
    assert len(sample.tokens) == len(sample.logprobs) == 8 and not sample.stopped
    forced = running.forced(ids, sample.tokens, adapter)
    assert all(f is not None and abs(lp - f) <= TOL for lp, f in zip(sample.logprobs, forced, strict=True)), \
        (sample.logprobs, forced)
    if adapter is not None:
        base = running.sample(ids, 8, stop=[]).samples[0]
        assert (base.tokens, base.logprobs) != (sample.tokens, sample.logprobs)


def test_max_tokens_and_a_stop_id_end_a_sample(running: Running) -> None:
    ids = prompt(running)
    greedy = running.sample(ids, 8, stop=[]).samples[0].tokens
    short = running.sample(ids, 3, stop=[]).samples[0]
    assert (short.tokens, short.stopped) == (greedy[:3], False)
    at = greedy.index(greedy[2])  # its first place
    stopped = running.sample(ids, 8, stop=[greedy[2]]).samples[0]
    assert (stopped.tokens, stopped.stopped) == (greedy[:at + 1], True)


def test_n_seeded_samples_repeat(running: Running) -> None:
    ids = prompt(running)
    first = running.sample(ids, 6, n=3, temperature=1.0, seed=17).samples
    again = running.sample(ids, 6, n=3, temperature=1.0, seed=17).samples
    assert len(first) == 3 and all(len(s.tokens) == len(s.logprobs) > 0 for s in first)
    assert [s.tokens for s in again] == [s.tokens for s in first]
    assert len({tuple(s.tokens) for s in first}) > 1  # each sample draws from its own seed
    assert all(lp <= 0 for s in first for lp in s.logprobs)


def test_prompt_logprobs_are_one_per_position(running: Running) -> None:
    """On a prompt that ends with a greedy sample of the adapter's, its positions score what the sample's own
    logprobs say; every position is what the teacher-forced pass says where that pass scores it (the worker's:
    all; vLLM's: those among its best two, none of a random prompt on the tiny model)."""
    ids = prompt(running, "A longer prompt of a few")
    sample = running.sample(ids, 4, stop=[], adapter="a").samples[0]
    whole = ids + sample.tokens
    scored = running.sample(whole, 2, prompt_logprobs=True, adapter="a").prompt_logprobs
    assert scored is not None and len(scored) == len(whole) and scored[0] is None
    assert all(lp is not None and lp <= 0 for lp in scored[1:])
    tail = [lp for lp in scored[len(ids):] if lp is not None]
    assert len(tail) == len(sample.logprobs)
    assert all(abs(lp - s) <= TOL for lp, s in zip(tail, sample.logprobs, strict=True)), (scored, sample.logprobs)
    forced = running.run(running.engine._client().teacher_forced(whole[:1], whole[1:], "a")).logprobs
    pairs = [(lp, f) for lp, f in zip(scored[1:], forced, strict=True) if f is not None]
    assert all(lp is not None and abs(lp - f) <= TOL for lp, f in pairs), (scored, forced)
    assert pairs or running.kind == "vllm"


def test_a_token_outside_the_vocabulary_is_a_400(running: Running) -> None:
    with pytest.raises(EngineError) as refused:
        running.sample([1, running.vocab + 10], 2)
    assert refused.value.status == 400, refused.value
    assert running.sample([1, 2], 1).samples[0].tokens  # and the engine serves on
