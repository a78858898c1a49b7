"""The batcher in-process on the tiny model: batching must not change any row's result."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from reefd.worker import sampling
from reefd.worker.batcher import SHARED_PREFILL_MAX, Batcher
from reefd.worker.generation import Generation
from reefd.worker.params import GenerateRequest, SamplingParams, parse_sampling
from tests.worker.support import reference_greedy

PROMPTS = [[5, 17, 99], [300, 2, 41, 41, 7, 8, 120, 64, 11], [77], [450, 451, 452, 453, 454]]


def request(prompt: list[int], **sampling: Any) -> tuple[GenerateRequest, list[int]]:
    return GenerateRequest(input_ids=prompt, text=None, sampling=parse_sampling(sampling)), prompt


async def collect(job: Generation) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": [], "logprobs": [], "top": [], "updates": 0, "text": ""}
    while True:
        update = await job.queue.get()
        out["ids"] += update.new_ids
        out["logprobs"] += update.new_logprobs
        out["top"] += update.new_top_logprobs
        out["updates"] += 1
        out["text"] += update.new_text
        if update.input_logprobs is not None:
            out["input_logprobs"], out["input_top_logprobs"] = update.input_logprobs, update.input_top_logprobs
        if update.finish is not None:
            out.update(finish=update.finish)
            return out


def run(engine: Any, reqs: list[tuple[GenerateRequest, list[int]]], max_batch: int = 8) -> tuple[list[dict], Batcher]:
    """Submit every request before the batcher starts, so they share the first wave."""

    async def main() -> tuple[list[dict], Batcher]:
        batcher = Batcher(engine, max_batch=max_batch, threads=1)
        jobs = [batcher.submit(req, prompt) for req, prompt in reqs]
        batcher.start()
        try:
            return list(await asyncio.gather(*(collect(j) for j in jobs))), batcher
        finally:
            batcher.stop()

    return asyncio.run(main())


def test_greedy_batch_equals_unbatched_argmax(engine: Any) -> None:
    results, batcher = run(engine, [request(p, temperature=0.0, max_new_tokens=12, ignore_eos=True) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids, logprobs = reference_greedy(engine, prompt, 12)
        assert result["ids"] == ids
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
        assert result["finish"] == {"type": "length", "length": 12}
    assert batcher.stats.max_running == len(PROMPTS)
    assert batcher.stats.prefills == 1


def test_seeded_sampling_ignores_batch_partners(engine: Any) -> None:
    target = request(PROMPTS[1], temperature=1.0, sampling_seed=1234, max_new_tokens=16, ignore_eos=True)
    alone, _ = run(engine, [target])
    partners = [request(p, temperature=0.8, top_p=0.9, max_new_tokens=5 + 3 * i, ignore_eos=True)
                for i, p in enumerate(PROMPTS)]
    together, batcher = run(engine, [partners[0], target, *partners[1:]])
    assert batcher.stats.max_running == 5
    assert together[1]["ids"] == alone[0]["ids"]
    assert together[1]["logprobs"] == pytest.approx(alone[0]["logprobs"], abs=1e-4)
    unseeded, _ = run(engine, [request(PROMPTS[1], temperature=1.0, max_new_tokens=16, ignore_eos=True)] * 2)
    assert unseeded[0]["ids"] != alone[0]["ids"] or unseeded[1]["ids"] != alone[0]["ids"]


def test_requests_joining_a_running_batch_keep_their_results(engine: Any) -> None:
    """Continuous batching: a request admitted mid-decode gets exactly its solo result."""

    async def main() -> list[dict]:
        batcher = Batcher(engine, max_batch=8, threads=1)
        batcher.start()
        try:
            first = batcher.submit(*request(PROMPTS[0], temperature=0.0, max_new_tokens=200, ignore_eos=True))
            while batcher.stats.decode_steps < 3:
                await asyncio.sleep(0.001)
            later = [
                batcher.submit(*request(p, temperature=0.0, max_new_tokens=10, ignore_eos=True)) for p in PROMPTS[1:]
            ]
            results = await asyncio.gather(collect(first), *(collect(j) for j in later))
            assert batcher.stats.prefills == 2
            assert batcher.stats.max_running == len(PROMPTS)  # the late ones joined the running row
            return list(results)
        finally:
            batcher.stop()

    results = asyncio.run(main())
    assert results[0]["ids"] == reference_greedy(engine, PROMPTS[0], 200)[0]
    for prompt, result in zip(PROMPTS[1:], results[1:], strict=True):
        assert result["ids"] == reference_greedy(engine, prompt, 10)[0]


def test_stop_token_and_eos_end_the_row_and_stay_in_output_ids(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    free, _ = run(engine, [request(PROMPTS[2], temperature=1.0, sampling_seed=9, max_new_tokens=12, ignore_eos=True)])
    ids = free[0]["ids"]
    stop = ids[4]
    cut = ids.index(stop) + 1
    by_stop_id, _ = run(
        engine, [request(PROMPTS[2], temperature=1.0, sampling_seed=9, max_new_tokens=12, stop_token_ids=[stop])]
    )
    assert by_stop_id[0]["ids"] == ids[:cut]
    assert by_stop_id[0]["finish"] == {"type": "stop", "matched": stop}
    assert by_stop_id[0]["text"] == engine.decode(ids[: cut - 1])
    monkeypatch.setattr(engine, "eos_ids", {stop})
    by_eos, _ = run(engine, [request(PROMPTS[2], temperature=1.0, sampling_seed=9, max_new_tokens=12)])
    assert by_eos[0]["ids"] == ids[:cut]
    assert by_eos[0]["finish"] == {"type": "stop", "matched": stop}
    ignored, _ = run(
        engine, [request(PROMPTS[2], temperature=1.0, sampling_seed=9, max_new_tokens=12, ignore_eos=True)]
    )
    assert ignored[0]["ids"] == ids


def test_prompt_logprobs_without_generation(engine: Any) -> None:
    prompt = PROMPTS[1]
    req = GenerateRequest(
        input_ids=prompt, text=None, sampling=SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0
    )
    other = request(PROMPTS[0], temperature=0.0, max_new_tokens=4)
    (result, partner), _ = run(engine, [(req, prompt), other])
    assert result["ids"] == [] and result["finish"] == {"type": "length", "length": 0}
    with torch.inference_mode():
        ref = engine.model(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = [None] + [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert [t for _, t, _ in result["input_logprobs"]] == prompt
    assert result["input_logprobs"][0][0] is None
    assert [lp for lp, _, _ in result["input_logprobs"][1:]] == pytest.approx(expected[1:], abs=1e-4)
    assert partner["ids"] == reference_greedy(engine, PROMPTS[0], 4)[0]


@pytest.mark.parametrize("start", [0, 1, 4, 8, 9, 50])
def test_prompt_logprobs_are_computed_in_chunks(engine: Any, monkeypatch: pytest.MonkeyPatch, start: int) -> None:
    """SGLang's shape: entries from logprob_start_len (at most the prompt's last token), its own without a logprob,
    and with top_logprobs_num each position's best."""
    monkeypatch.setattr(sampling, "LOGPROB_CHUNK", 2)
    prompt = PROMPTS[1]
    req = GenerateRequest(
        input_ids=prompt,
        text=None,
        sampling=SamplingParams(max_new_tokens=1),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=2,
    )
    (result,), _ = run(engine, [(req, prompt)])
    with torch.inference_mode():
        ref = engine.model(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
    first = min(start, len(prompt) - 1)
    expected = [[None, prompt[first], None]]
    expected += [[float(ref[i - 1, prompt[i]]), prompt[i], None] for i in range(first + 1, len(prompt))]
    assert [t for _, t, _ in result["input_logprobs"]] == [t for _, t, _ in expected] == prompt[first:]
    assert result["input_logprobs"][0][0] is None
    got = [lp for lp, _, _ in result["input_logprobs"][1:]]
    assert got == pytest.approx([lp for lp, _, _ in expected[1:]], abs=1e-4)
    tops = result["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(expected)
    for i, row in zip(range(first + 1, len(prompt)), tops[1:], strict=True):
        best = ref[i - 1].topk(2)
        assert [t for _, t, _ in row] == best.indices.tolist()
        assert [lp for lp, _, _ in row] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_short_scoring_requests_share_a_prefill_and_get_what_they_get_alone(engine: Any) -> None:
    """Requests for a few prompt positions' logprobs (a release proof's probes) are prefilled together, apart from
    plain ones; each row's entries are what it gets prefilled alone."""
    def scoring(prompt: list[int], start: int) -> tuple[GenerateRequest, list[int]]:
        return GenerateRequest(input_ids=prompt, text=None, sampling=SamplingParams(max_new_tokens=1, temperature=0),
                               return_logprob=True, logprob_start_len=start, top_logprobs_num=1), prompt

    reqs = [scoring(PROMPTS[1], 3), scoring(PROMPTS[3], 1), scoring(PROMPTS[0], 0)]
    together, batcher = run(engine, [*reqs, request(PROMPTS[2], temperature=0.0, max_new_tokens=3)])
    assert batcher.stats.prefills == 2  # the plain request, then the three scoring ones
    for req, result in zip(reqs, together[:3], strict=True):
        (alone,), _ = run(engine, [req])
        assert [t for _, t, _ in result["input_logprobs"]] == [t for _, t, _ in alone["input_logprobs"]]
        assert [lp for lp, _, _ in result["input_logprobs"][1:]] == pytest.approx(
            [lp for lp, _, _ in alone["input_logprobs"][1:]], abs=1e-4)
        assert [row[0][1] for row in result["input_top_logprobs"][1:]] == \
            [row[0][1] for row in alone["input_top_logprobs"][1:]]
        assert result["ids"] == alone["ids"]


def test_long_prompts_are_prefilled_alone_and_batched_with_short_ones(engine: Any) -> None:
    """A prompt over SHARED_PREFILL_MAX gets its own (unpadded) prefill, then decodes with the rest."""
    long = [(i * 37) % 4000 + 3 for i in range(3 * SHARED_PREFILL_MAX)]
    prompts = [PROMPTS[0], long, PROMPTS[1], long[: SHARED_PREFILL_MAX + 5]]
    results, batcher = run(engine, [request(p, temperature=0.0, max_new_tokens=6, ignore_eos=True) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        ids, logprobs = reference_greedy(engine, prompt, 6)
        assert result["ids"] == ids
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert batcher.stats.prefills == 3  # the two short prompts together, each long one alone
    assert batcher.stats.max_running == 4


def test_a_prefill_without_padding_passes_no_attention_mask(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No mask lets SDPA run its causal kernel: nothing of size prompt x prompt is built."""
    masks: list[Any] = []
    forward = engine.model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        masks.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    with torch.inference_mode():
        engine.prefill([[1, 2, 3], [4, 5, 6]])
        engine.prefill([[1, 2, 3], [4, 5]])
    assert masks[0] is None
    assert masks[1] is not None and masks[1].tolist() == [[1, 1, 1], [0, 1, 1]]


def test_prompts_that_open_alike_or_repeat_run_the_shared_part_once(engine: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's common opening runs once at batch 1, each distinct rest once after it; every row still gets what it
    gets alone (greedy ids and logprobs, and a seeded sample beside the same prompt asked again)."""
    opening = [(i * 53) % 900 + 20 for i in range(12)]
    prompts = [[*opening, 5, 17, 99], [*opening, 300, 2, 41, 41, 7], [*opening, 5, 17, 99], [*opening, 77]]
    shapes: list[tuple[int, ...]] = []
    forward = engine.model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    results, batcher = run(engine, [request(p, temperature=0.0, max_new_tokens=6, ignore_eos=True) for p in prompts])
    assert shapes[:2] == [(1, 12), (3, 5)]  # the opening, then the three distinct rests, left-padded
    assert batcher.stats.prefills == 1
    monkeypatch.setattr(engine.model, "forward", forward)
    for prompt, result in zip(prompts, results, strict=True):
        ids, logprobs = reference_greedy(engine, prompt, 6)
        assert result["ids"] == ids
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    seeded = request(prompts[1], temperature=1.0, sampling_seed=99, max_new_tokens=8, ignore_eos=True)
    alone, _ = run(engine, [seeded])
    together, _ = run(engine, [request(prompts[1], temperature=1.0, max_new_tokens=8, ignore_eos=True), seeded,
                               request(prompts[0], temperature=0.7, max_new_tokens=3)])
    assert together[1]["ids"] == alone[0]["ids"]
    assert together[1]["logprobs"] == pytest.approx(alone[0]["logprobs"], abs=1e-4)


def test_streaming_rows_get_every_step_and_others_one_final_update(engine: Any) -> None:
    streaming = GenerateRequest(
        input_ids=PROMPTS[0], text=None, stream=True, sampling=SamplingParams(temperature=0.0, max_new_tokens=6)
    )
    plain = request(PROMPTS[0], temperature=0.0, max_new_tokens=6)
    (s, p), _ = run(engine, [(streaming, PROMPTS[0]), plain])
    assert s["ids"] == p["ids"]
    assert p["updates"] == 1
    assert s["updates"] > 1


def test_each_row_gets_its_own_number_of_top_logprobs(engine: Any) -> None:
    def top(k: int, prompt: list[int], logprob: bool = True, stream: bool = False, **sampling: Any) -> Any:
        sp = parse_sampling({"max_new_tokens": 7, "ignore_eos": True, **sampling})
        req = GenerateRequest(prompt, None, sp, return_logprob=logprob, top_logprobs_num=k, stream=stream)
        return req, prompt

    reqs = [
        top(0, PROMPTS[0], temperature=0.0),
        top(2, PROMPTS[1], temperature=0.0),
        top(5, PROMPTS[2], temperature=0.0, stream=True),
        top(4, PROMPTS[3], temperature=0.7, top_p=0.9, seed=3),  # raw logits: before temperature, filters
        top(3, PROMPTS[0], logprob=False, temperature=0.0),  # no logprobs asked: no top logprobs either
        top(3, PROMPTS[1], max_new_tokens=0),  # prefill only: no output token, no top logprobs
    ]
    results, batcher = run(engine, reqs)
    assert batcher.stats.prefills == 1 and batcher.stats.max_running == len(reqs) - 1  # one batch
    assert [len(r["top"]) for r in results] == [0, 7, 7, 7, 0, 0]
    for (req, prompt), result in zip(reqs[1:4], results[1:4], strict=True):
        k = req.top_logprobs_num
        assert [len(entries) for entries in result["top"]] == [k] * 7
        steps = zip(result["ids"], result["logprobs"], result["top"], strict=True)
        for step, (token, logprob, entries) in enumerate(steps):
            with torch.inference_mode():  # the reference: a full forward, raw log_softmax
                logits = engine.model(input_ids=torch.tensor([prompt + result["ids"][:step]])).logits[0, -1]
            values, ids = logits.log_softmax(-1).topk(k)
            assert [t for _, t, _ in entries] == ids.tolist()
            assert [v for v, _, _ in entries] == pytest.approx(values.tolist(), abs=1e-4)
            same = [v for v, t, _ in entries if t == token]
            assert same == pytest.approx([logprob], abs=1e-6) if same else logprob <= entries[-1][0] + 1e-6
            if req.sampling.greedy:
                assert entries[0][1] == token


def test_cancelled_job_leaves_the_batch(engine: Any) -> None:
    async def main() -> tuple[dict, Batcher]:
        batcher = Batcher(engine, max_batch=8, threads=1)
        doomed = batcher.submit(*request(PROMPTS[0], max_new_tokens=10_000, ignore_eos=True))
        kept = batcher.submit(*request(PROMPTS[1], temperature=0.0, max_new_tokens=30, ignore_eos=True))
        batcher.start()
        try:
            while batcher.stats.decode_steps < 2:
                await asyncio.sleep(0.001)
            doomed.cancelled = True
            result = await collect(kept)
            return result, batcher
        finally:
            batcher.stop()

    result, batcher = asyncio.run(main())
    assert result["ids"] == reference_greedy(engine, PROMPTS[1], 30)[0]
    assert batcher.stats.requests_completed == 2
    assert not batcher.rows


def test_finished_rows_stay_until_a_quarter_of_the_batch_has_finished(engine: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping rows copies the kept rows' cache: one finished row of eight stays (its client has its answer, and
    no second one), two are dropped together, and the last rows leave with no copy at all."""
    from reefd.worker import batcher as module

    kept: list[int] = []
    select = module.kvcache.select
    monkeypatch.setattr(module.kvcache, "select", lambda kv, mask, rows: kept.append(len(rows)) or
                        select(kv, mask, rows))
    prompts = [[p[0] + i, *p[1:]] for i, p in enumerate(PROMPTS * 2)]
    lengths = [2, 4, 9, 9, 9, 9, 9, 9]

    async def main() -> tuple[list[dict], list[Generation], Batcher]:
        batcher = Batcher(engine, max_batch=8, threads=1)
        jobs = [batcher.submit(*request(p, temperature=0.0, max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, lengths, strict=True)]
        batcher.start()
        try:
            results = list(await asyncio.gather(*(collect(j) for j in jobs)))
            await asyncio.sleep(0.05)
            return results, jobs, batcher
        finally:
            batcher.stop()

    results, jobs, batcher = asyncio.run(main())
    assert kept == [6]  # rows 1 and 2 together, after the second had finished; none when the last six finished
    for prompt, n, result, job in zip(prompts, lengths, results, jobs, strict=True):
        assert result["ids"] == reference_greedy(engine, prompt, n)[0]
        assert result["updates"] == 1 and job.queue.empty()  # one final update, never a second
    assert batcher.stats.requests_completed == 8 and not batcher.rows


def test_a_finished_row_leaves_at_once_when_it_would_pass_the_live_rows_or_a_request_waits(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished row whose position passes every live row's would widen the cache, and could pass the context
    length or move a position-dependent scaling: it leaves at once. So does any finished row while a request
    waits for room."""
    from reefd.worker import batcher as module

    kept: list[int] = []
    select = module.kvcache.select
    monkeypatch.setattr(module.kvcache, "select", lambda kv, mask, rows: kept.append(len(rows)) or
                        select(kv, mask, rows))
    long = [(i * 37) % 900 + 3 for i in range(30)]
    short = [[p[0] + i, *p[1:]] for i, p in enumerate(PROMPTS * 2)][:7]
    results, _ = run(engine, [request(long, temperature=0.0, max_new_tokens=2, ignore_eos=True),
                              *(request(p, temperature=0.0, max_new_tokens=8, ignore_eos=True) for p in short)])
    assert kept == [7]  # the long row, one of eight, left as soon as it finished
    assert results[0]["ids"] == reference_greedy(engine, long, 2)[0]
    for prompt, result in zip(short, results[1:], strict=True):
        assert result["ids"] == reference_greedy(engine, prompt, 8)[0]

    async def main() -> tuple[int, dict, dict]:
        batcher = Batcher(engine, max_batch=5, threads=1)
        first = [batcher.submit(*request(PROMPTS[0], temperature=0.0, max_new_tokens=2, ignore_eos=True)),
                 *(batcher.submit(*request([p + 1 for p in PROMPTS[1]], temperature=0.0, max_new_tokens=40,
                                           ignore_eos=True)) for _ in range(4))]
        batcher.start()
        try:
            await collect(first[0])
            late = batcher.submit(*request(PROMPTS[3], temperature=0.0, max_new_tokens=3, ignore_eos=True))
            answer = await collect(late)
            steps = batcher.stats.decode_steps
            await asyncio.gather(*(collect(j) for j in first[1:]))
            return steps, answer, {"steps": batcher.stats.decode_steps}
        finally:
            batcher.stop()

    steps, answer, total = asyncio.run(main())
    assert answer["ids"] == reference_greedy(engine, PROMPTS[3], 3)[0]
    assert steps < total["steps"]  # the late request got the finished row's place while the others ran on


def test_stop_aborts_waiting_and_running_jobs(engine: Any) -> None:
    async def main() -> list[dict]:
        batcher = Batcher(engine, max_batch=1, threads=1)
        jobs = [batcher.submit(*request(p, max_new_tokens=1900, ignore_eos=True)) for p in PROMPTS[:2]]
        batcher.start()
        while batcher.stats.decode_steps < 1:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(batcher.stop)
        return list(await asyncio.gather(*(collect(j) for j in jobs)))

    for result in asyncio.run(main()):
        assert result["finish"]["type"] == "abort"
