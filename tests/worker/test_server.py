"""The worker over HTTP (a real subprocess): SGLang's /generate, health and info routes."""

from __future__ import annotations

import itertools
import json
import math
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.worker.agent_turn import first_turn
from tests.worker.support import Worker, reference_greedy

CONTEXT = 65536  # the tiny model's context length


def generate(worker: Worker, **body: Any) -> dict[str, Any]:
    status, answer = worker.post("/generate", body)
    assert status == 200, answer
    return dict(answer)


def test_generate_returns_ids_logprobs_and_counts(worker: Worker, engine: Any) -> None:
    prompt = [11, 12, 13, 14]
    answer = generate(
        worker,
        input_ids=prompt,
        return_logprob=True,
        rid="r-1",
        sampling_params={"max_new_tokens": 9, "temperature": 0, "ignore_eos": True},
    )
    meta = answer["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 9 == len(answer["output_ids"])
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0
    assert [t for _, t, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    assert all(math.isfinite(lp) and lp <= 0 and extra is None for lp, _, extra in meta["output_token_logprobs"])
    assert "input_token_logprobs" not in meta
    ids, logprobs = reference_greedy(engine, prompt, 9)
    assert answer["output_ids"] == ids  # temperature 0 is the argmax of the model
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)
    assert answer["text"] == engine.decode(ids)


def test_text_and_input_ids_are_the_same_request(worker: Worker, engine: Any) -> None:
    params = {"max_new_tokens": 5, "temperature": 0}
    by_text = generate(worker, text="Hello reef", sampling_params=params)
    by_ids = generate(worker, input_ids=engine.encode("Hello reef"), sampling_params=params)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(engine.encode("Hello reef"))


def test_input_token_logprobs(worker: Worker) -> None:
    prompt = [40, 41, 42, 43, 44]
    meta = generate(
        worker, input_ids=prompt, return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 2}
    )["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt
    assert entries[0][0] is None
    assert all(lp <= 0 for lp, _, _ in entries[1:])
    tail = generate(
        worker, input_ids=prompt, return_logprob=True, logprob_start_len=3, top_logprobs_num=2,
        sampling_params={"max_new_tokens": 1}
    )["meta_info"]
    # SGLang's shape: from logprob_start_len, whose own entry has no logprob, the others each with their best
    assert [t for _, t, _ in tail["input_token_logprobs"]] == prompt[3:] and tail["input_token_logprobs"][0][0] is None
    assert [lp for lp, _, _ in tail["input_token_logprobs"][1:]] == pytest.approx(
        [lp for lp, _, _ in entries[4:]], abs=1e-4)
    tops = tail["input_top_logprobs"]
    assert tops[0] is None and len(tops) == 2 and all(len(row) == 2 and row[0][0] >= row[1][0] for row in tops[1:])
    assert "input_top_logprobs" not in meta  # only with top_logprobs_num


def test_streaming_chunks_are_cumulative(worker: Worker) -> None:
    body = {
        "input_ids": [7, 8, 9],
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    events = worker.stream("/generate", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["meta_info"]["completion_tokens"] == 12 == len(last["meta_info"]["output_token_logprobs"])
    plain = generate(worker, **{**body, "stream": False})
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]


def test_incremental_streaming_sends_only_what_is_new(fresh_worker: Worker) -> None:
    """SGLang's --incremental-streaming-output: each event has the new ids, text and output logprobs only, so an
    event's size does not grow with the answer; together they are exactly the whole answer."""
    fresh_worker.extra = ["--incremental-streaming-output", "--threads", "1"]
    fresh_worker.start()
    body = {"input_ids": [7, 8, 9], "stream": True, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    events = fresh_worker.stream("/generate", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 10
    ids = [t for c in chunks for t in c["output_ids"]]
    plain = generate(fresh_worker, **{**body, "stream": False})
    assert ids == plain["output_ids"]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    logprobs = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in logprobs] == ids
    expected = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
    assert [lp for lp, _, _ in logprobs] == pytest.approx(expected, abs=1e-5)
    assert sum(len(c["meta_info"]["output_top_logprobs"]) for c in chunks) == 400
    seen = 0
    for chunk in chunks:
        seen += len(chunk["output_ids"])
        assert chunk["meta_info"]["completion_tokens"] == seen  # the count stays cumulative, as in SGLang
        assert len(chunk["meta_info"]["output_token_logprobs"]) == len(chunk["output_ids"])
    assert max(len(json.dumps(c)) for c in chunks) < 4 * len(json.dumps(chunks[0])) + 512
    status, info = fresh_worker.get("/get_server_info")
    assert status == 200 and json.loads(info)["incremental_streaming_output"] is True


def check_top_logprobs(meta: dict[str, Any], ids: list[int], k: int) -> None:
    """K distinct [logprob, id, None] per output token, best first, consistent with output_token_logprobs."""
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(ids) == len(meta["output_token_logprobs"])
    for entries, (logprob, token, _) in zip(tops, meta["output_token_logprobs"], strict=True):
        values = [v for v, _, _ in entries]
        assert len(entries) == k and len({t for _, t, _ in entries}) == k
        assert all(extra is None for _, _, extra in entries)
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        for value in (v for v, t, _ in entries if t == token):  # the sampled token, when it is among the top K
            assert value == pytest.approx(logprob, abs=1e-6)


def test_top_logprobs(worker: Worker, engine: Any) -> None:
    prompt = [11, 12, 13, 14]
    params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    meta = generate(worker, input_ids=prompt, return_logprob=True, top_logprobs_num=4, sampling_params=params)[
        "meta_info"
    ]
    ids = [t for _, t, _ in meta["output_token_logprobs"]]
    check_top_logprobs(meta, ids, 4)
    for entries, (logprob, token, _) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"], strict=True):
        assert entries[0][1] == token and entries[0][0] == pytest.approx(logprob, abs=1e-6)  # greedy: the top-1
    assert ids == reference_greedy(engine, prompt, 9)[0]
    sampled = {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 4, "ignore_eos": True}
    answer = generate(worker, input_ids=prompt, return_logprob=True, top_logprobs_num=3, sampling_params=sampled)
    check_top_logprobs(answer["meta_info"], answer["output_ids"], 3)
    plain = generate(worker, input_ids=prompt, top_logprobs_num=4, sampling_params=params)["meta_info"]
    assert not {"output_token_logprobs", "output_top_logprobs"} & plain.keys()  # SGLang: no return_logprob, none
    assert "output_top_logprobs" not in generate(worker, input_ids=prompt, return_logprob=True)["meta_info"]
    prefill = generate(
        worker, input_ids=prompt, return_logprob=True, top_logprobs_num=4, sampling_params={"max_new_tokens": 0}
    )["meta_info"]
    assert prefill["output_top_logprobs"] == [] == prefill["output_token_logprobs"]


def test_streamed_top_logprobs_are_cumulative(worker: Worker) -> None:
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [7, 8, 9], "stream": True, "return_logprob": True, "top_logprobs_num": 3}
    chunks = worker.stream("/generate", {**body, "sampling_params": params})[:-1]
    assert len(chunks) >= 2
    for before, after in itertools.pairwise(chunks):
        old = before["meta_info"]["output_top_logprobs"]
        assert after["meta_info"]["output_top_logprobs"][: len(old)] == old
    for chunk in chunks:
        check_top_logprobs(chunk["meta_info"], chunk["output_ids"], 3)
    last = chunks[-1]["meta_info"]["output_top_logprobs"]
    plain = generate(worker, **{**body, "stream": False}, sampling_params=params)["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in e] for e in last] == [[t for _, t, _ in e] for e in plain]


def test_top_logprobs_num_is_checked(worker: Worker) -> None:
    for bad in (-1, "x", 21):
        body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": bad}
        status, answer = worker.post("/generate", body)
        assert status == 400, answer
        assert "top_logprobs_num" in answer["error"]["message"]


def test_concurrent_requests_get_their_own_top_logprobs(worker: Worker) -> None:
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ks = [0, 2, 5, 0, 2, 5]
    bodies = [
        {"input_ids": [60 + i, 61], "return_logprob": True, "top_logprobs_num": k, "sampling_params": params}
        for i, k in enumerate(ks)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: generate(worker, **b), bodies))
    for k, answer in zip(ks, results, strict=True):
        if k:
            check_top_logprobs(answer["meta_info"], answer["output_ids"], k)
        else:
            assert "output_top_logprobs" not in answer["meta_info"]


def test_stop_string_is_trimmed_and_reported(worker: Worker) -> None:
    params = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 21, "ignore_eos": True}
    free = generate(worker, input_ids=[100, 101], sampling_params=params)
    text = free["text"]
    stop = next(
        text[i : i + 2] for i in range(8, len(text) - 2) if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    cut = text.index(stop)
    stopped = generate(worker, input_ids=[100, 101], sampling_params={**params, "stop": [stop, "never-seen"]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[:cut]
    assert free["output_ids"][: len(stopped["output_ids"])] == stopped["output_ids"]
    events = worker.stream(
        "/generate", {"input_ids": [100, 101], "stream": True, "sampling_params": {**params, "stop": stop}}
    )
    assert all(stop not in e["text"] for e in events[:-1])
    assert events[-2]["text"] == text[:cut]


def test_stop_token_ids_end_generation(worker: Worker, engine: Any) -> None:
    params = {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}
    free = generate(worker, input_ids=[9, 10], sampling_params=params)["output_ids"]
    stop = free[3]
    del params["ignore_eos"]  # ignore_eos also disables stop_token_ids, as in SGLang
    answer = generate(worker, input_ids=[9, 10], sampling_params={**params, "stop_token_ids": [stop]})
    end = next(i for i, t in enumerate(free) if t == stop or t in engine.eos_ids)
    assert answer["output_ids"] == free[: end + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_seed_reproduces_alone_and_among_concurrent_requests(worker: Worker) -> None:
    body = {
        "input_ids": [3, 4, 5, 6],
        "sampling_params": {"max_new_tokens": 24, "sampling_seed": 99, "ignore_eos": True},
    }
    first, second = generate(worker, **body), generate(worker, **body)
    assert first["output_ids"] == second["output_ids"]
    alias = generate(
        worker, input_ids=[3, 4, 5, 6], sampling_params={"max_new_tokens": 24, "seed": 99, "ignore_eos": True}
    )
    assert alias["output_ids"] == first["output_ids"]
    others = [
        {"input_ids": list(range(20, 20 + n)), "sampling_params": {"max_new_tokens": 10 + n}} for n in range(1, 8)
    ]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: generate(worker, **b), [*others[:3], body, *others[3:]]))
    assert results[3]["output_ids"] == first["output_ids"]


def test_concurrent_requests_are_batched_and_correct(worker: Worker, engine: Any) -> None:
    prompts = [[50 + i] * (1 + i) for i in range(8)]
    bodies = [
        {"input_ids": p, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}
        for p in prompts
    ]
    before = worker.stats()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: generate(worker, **b), bodies))
    after = worker.stats()
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == reference_greedy(engine, prompt, 30)[0]
        assert result["meta_info"]["completion_tokens"] == 30
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert rows == 8 * 29  # every token after the first comes from a decode step
    assert steps < rows  # several requests shared decode steps
    assert after["max_running"] >= 2


def test_bad_requests_are_400_in_openai_shape(worker: Worker) -> None:
    cases: list[bytes | dict[str, Any]] = [
        b"{not json",
        {"sampling_params": {}},
        {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
        {"input_ids": [1, 10_000_000]},
        {"input_ids": [1], "sampling_params": {"beam_width": 4}},
    ]
    for body in cases:
        status, answer = worker.post("/generate", body)
        assert status == 400, body
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"]


def test_health_and_info_routes(worker: Worker, tiny_model: Any) -> None:
    assert worker.get("/health")[0] == 200
    assert worker.get("/health_generate")[0] == 200
    for path in ("/server_info", "/get_server_info"):
        status, body = worker.get(path)
        info = json.loads(body)
        assert status == 200
        assert info["model_path"] == str(tiny_model) == info["tokenizer_path"]
        assert info["max_batch"] == 8 and info["version"]
        assert info["context_length"] == CONTEXT
        assert info["stats"]["tokens_generated"] >= 1
    status, body = worker.get("/get_model_info")
    assert status == 200
    assert json.loads(body) == {
        "model_path": str(tiny_model),
        "tokenizer_path": str(tiny_model),
        "is_generation": True,
        "served_model_name": "tiny",
        "context_length": CONTEXT,
    }


def test_a_40k_token_agent_prompt_is_answered_beside_short_ones(worker: Worker, engine: Any) -> None:
    """A coding agent's first turn at ~40k tokens: prefilled alone, decoded with the short rows."""
    messages, tools = first_turn(150_000)
    text = engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    assert 35_000 <= len(prompt) <= 45_000
    params = {"temperature": 0, "ignore_eos": True}
    short = [[5, 17, 99], [300, 2, 41, 41, 7]]
    bodies = [
        {"input_ids": prompt, "sampling_params": {**params, "max_new_tokens": 4}},
        *({"input_ids": p, "sampling_params": {**params, "max_new_tokens": 12}} for p in short),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        long, *others = pool.map(lambda b: generate(worker, **b), bodies)
    assert long["meta_info"]["prompt_tokens"] == len(prompt)
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(long["output_ids"]) == 4
    for p, answer in zip(short, others, strict=True):
        assert answer["output_ids"] == reference_greedy(engine, p, 12)[0]


def test_a_prompt_over_the_context_length_is_a_400(worker: Worker) -> None:
    words = "hello " * (CONTEXT + 100)
    for path, body in [
        ("/generate", {"input_ids": [5] * CONTEXT}),
        ("/generate", {"text": words}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": words}]}),
    ]:
        status, answer = worker.post(path, body)
        assert status == 400, (path, answer)
        assert answer["error"]["type"] == "invalid_request_error"
        assert f"context length is {CONTEXT} tokens" in answer["error"]["message"]
    assert generate(worker, input_ids=[5] * 3, sampling_params={"max_new_tokens": 1})["output_ids"]  # still serving


@pytest.fixture(scope="module")
def short_worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker whose context length is cut to 64 tokens (SGLang's --context-length)."""
    w = Worker(tiny_model, tmp_path_factory.mktemp("short") / "worker.log", ["--context-length", "64"])
    w.start()
    yield w
    assert w.stop() == 0, w.logs()


def test_max_new_tokens_past_the_context_is_capped(short_worker: Worker) -> None:
    params = {"max_new_tokens": 50, "ignore_eos": True, "sampling_seed": 1}
    answer = generate(short_worker, input_ids=list(range(10, 70)), sampling_params=params)
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 4}  # 60 + 4 = 64
    assert answer["meta_info"]["completion_tokens"] == 4 == len(answer["output_ids"])
    body = {"input_ids": list(range(10, 73)), "stream": True, "sampling_params": params}
    last = short_worker.stream("/generate", body)
    assert last[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    status, error = short_worker.post("/generate", {"input_ids": list(range(10, 74))})
    assert status == 400 and "context length is 64 tokens" in error["error"]["message"]
    for path in ("/server_info", "/get_model_info"):
        assert json.loads(short_worker.get(path)[1])["context_length"] == 64


def test_a_context_length_longer_than_the_models_is_refused(tiny_model: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reefd.worker",
            "--model",
            str(tiny_model),
            "--port",
            "0",
            "--context-length",
            str(CONTEXT + 1),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"context length {CONTEXT + 1} is outside" in done.stderr


def test_sigterm_aborts_in_flight_requests_and_exits_zero(fresh_worker: Worker) -> None:
    fresh_worker.extra = ["--drain-timeout", "0"]
    fresh_worker.start()
    answers: list[tuple[int, Any]] = []
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2045, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: answers.append(fresh_worker.post("/generate", body)))
    thread.start()
    while fresh_worker.stats()["decode_steps"] < 2:
        time.sleep(0.01)
    assert fresh_worker.stop(signal.SIGTERM) == 0, fresh_worker.logs()
    thread.join(60)
    status, answer = answers[0]
    assert status == 503 and answer["error"]["type"] == "server_error"
    assert "stopping" in fresh_worker.logs()


def test_a_client_that_leaves_frees_its_row(worker: Worker) -> None:
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 2045, "ignore_eos": True}}
    before = worker.stats()
    req = urllib.request.Request(worker.url + "/generate", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")
    while worker.stats()["requests_completed"] == before["requests_completed"]:
        time.sleep(0.01)
    after = worker.stats()
    assert after["tokens_generated"] - before["tokens_generated"] < 2045  # aborted, not finished
    assert json.loads(worker.get("/server_info")[1])["running_requests"] == 0


def test_pause_and_continue_generation_as_sglang(worker: Worker) -> None:
    """What a trainer pushing weights does (slime's disk transport): pause (abort), flush the cache, load, continue.
    A request sent while paused waits, and is answered after /continue_generation."""
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2045, "ignore_eos": True}}
    answers: list[tuple[int, Any]] = []
    running = threading.Thread(target=lambda: answers.append(worker.post("/generate", long)))
    running.start()
    while json.loads(worker.get("/server_info")[1])["running_requests"] == 0:
        time.sleep(0.01)
    assert worker.get("/flush_cache")[0] == 400  # SGLang flushes only an idle server
    try:
        assert worker.post("/pause_generation", {}) == (200, {"message": "Generation paused successfully.",
                                                             "status": "ok"})
        running.join(60)
        assert answers[0][0] == 503 and "aborted by pause_generation" in answers[0][1]["error"]["message"]
        status, text = worker.get("/flush_cache")
        assert status == 200 and text.startswith(b"Cache flushed.")
        info = json.loads(worker.get("/server_info")[1])
        assert info["is_paused"] is True and (info["tp_size"], info["pp_size"], info["enable_memory_saver"]) == \
            (1, 1, False)
        waiting: list[tuple[int, Any]] = []
        held = threading.Thread(target=lambda: waiting.append(worker.post("/generate", {
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})))
        held.start()
        time.sleep(0.5)
        assert waiting == []  # held while paused
        assert worker.post("/continue_generation", {}) == (200, {"message": "Generation continued successfully.",
                                                                "status": "ok"})
        held.join(60)
        assert waiting[0][0] == 200 and waiting[0][1]["meta_info"]["completion_tokens"] == 2
        assert worker.post("/pause_generation", {"mode": "later"})[0] == 400
        assert json.loads(worker.get("/server_info")[1])["is_paused"] is False
    finally:  # the worker is shared: never leave it paused for the next test
        worker.post("/continue_generation", {})
