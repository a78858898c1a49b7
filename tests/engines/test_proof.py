"""The release proof's rule (reefd/engines/proof.py) on made-up answers: a logprob at the tolerance passes and just
past it fails, a near-tie may go to the reference's runner-up within 2 x the tolerance and not past it, a wrong
best token that is not a near-tie fails, and every position is compared; the SGLang and vLLM readings of a
teacher-forced probe (SGLangClient.teacher_forced, vllm_client.forced) against their documented shapes."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import pytest

from reefd.engines import EngineError
from reefd.engines.proof import DEFAULT_TOLERANCE, Fingerprint, Scored
from reefd.engines.sglang_client import SGLangClient
from reefd.engines.vllm_client import forced
from tests.engines.test_sglang_client import serve

TOL = DEFAULT_TOLERANCE
# two prompts; per token the reference's id, logprob, runner-up and margin (prompt 1's token 0 is a near-tie)
FP = Fingerprint(prompts=[[1, 2, 3], [4, 5]], tokens=[[10, 11, 12], [20, 21]],
                 logprobs=[[-0.5, -1.0, -2.0], [-0.7, -0.3]], second=[[30, 31, 32], [40, 41]],
                 margins=[[1.0, 0.8, 0.6], [0.04, 0.9]])


def honest(fp: Fingerprint = FP) -> list[Scored]:
    """What a process that computes as the reference answers: its logprobs, its tokens."""
    return [Scored(list(lps), list(ids), list(lps)) for ids, lps in zip(fp.tokens, fp.logprobs, strict=True)]


def moved(i: int, j: int, by: float, best: int | None = None, best_logprob: float | None = None) -> list[Scored]:
    """The honest answers with position (i, j)'s logprob moved by `by` (and its best token changed)."""
    answers = honest()
    lps = answers[i].logprobs
    lps[j] = FP.logprobs[i][j] + by
    if best is not None:
        answers[i].best[j] = best
        answers[i].best_logprobs[j] = FP.logprobs[i][j] + by if best_logprob is None else best_logprob
    return answers


def test_the_reference_s_own_answers_pass() -> None:
    assert FP.mismatch(honest()) is None


@pytest.mark.parametrize("by", [TOL, -TOL, TOL - 1e-4, -(TOL - 1e-4)])
def test_a_logprob_at_or_just_under_the_tolerance_passes(by: float) -> None:
    assert FP.mismatch(moved(0, 1, by)) is None


@pytest.mark.parametrize("by", [TOL + 1e-4, -(TOL + 1e-4), 2 * TOL])
def test_a_logprob_just_over_the_tolerance_fails(by: float) -> None:
    problem = FP.mismatch(moved(0, 1, by))
    assert problem is not None and problem.startswith("prompt 0, token 1: logprob") and "tolerance 0.05" in problem


def test_every_position_is_compared() -> None:
    """The last token of the last prompt, and a position after a near-tie that went the other way (teacher
    forcing keeps the reference's context, so what follows it still counts)."""
    assert FP.mismatch(moved(1, 1, -0.06)) is not None
    tie = moved(1, 0, 0.0, best=40, best_logprob=-0.7 - 0.04)
    assert FP.mismatch(tie) is None
    tie[1].logprobs[1] = -0.3 - 0.06
    assert FP.mismatch(tie) == FP.mismatch(moved(1, 1, -0.06))


def test_a_tolerance_set_for_the_scenario_is_the_one_applied() -> None:
    assert FP.within(0.1).mismatch(moved(0, 0, 0.09)) is None
    assert FP.within(0.01).mismatch(moved(0, 0, 0.02)) is not None


def near_tie(margin: float, best_logprob_off: float = 0.0) -> tuple[Fingerprint, list[Scored]]:
    """Position (0, 0) a near-tie of `margin`, decided the other way: the process's best is the runner-up, with
    the logprob the reference gives it (moved by `best_logprob_off`); the reference's token a little below."""
    fp = Fingerprint(prompts=[[1]], tokens=[[10]], logprobs=[[-1.0]], second=[[30]], margins=[[margin]])
    return fp, [Scored([-1.0], [30], [-1.0 - margin + best_logprob_off])]


@pytest.mark.parametrize("margin", [0.0, TOL, 2 * TOL])
def test_a_near_tie_within_twice_the_tolerance_may_go_to_the_runner_up(margin: float) -> None:
    fp, answers = near_tie(margin)
    assert fp.mismatch(answers) is None


@pytest.mark.parametrize("margin", [2 * TOL + 1e-4, 0.5])
def test_a_runner_up_past_twice_the_tolerance_fails(margin: float) -> None:
    fp, answers = near_tie(margin)
    problem = fp.mismatch(answers)
    assert problem is not None and "the best token is 30 where the release's is 10" in problem


def test_a_near_tie_s_runner_up_must_have_its_own_logprob() -> None:
    fp, answers = near_tie(0.05, best_logprob_off=TOL + 1e-4)
    problem = fp.mismatch(answers)
    assert problem is not None and "the runner-up 30 is best with logprob" in problem
    assert fp.mismatch(near_tie(0.05, best_logprob_off=TOL)[1]) is None


def test_a_wrong_best_token_that_is_not_the_runner_up_fails_even_in_a_tie() -> None:
    fp = Fingerprint(prompts=[[1]], tokens=[[10]], logprobs=[[-1.0]], second=[[30]], margins=[[0.0]])
    problem = fp.mismatch([Scored([-1.0], [99], [-1.0])])
    assert problem is not None and "the best token is 99" in problem
    assert FP.mismatch(moved(0, 2, 0.0, best=77, best_logprob=-1.0)) is not None  # and outside one


def test_an_unscored_or_short_answer_fails() -> None:
    answers = honest()
    answers[0].logprobs[2] = None  # vLLM: the reference's token was not among the best it reported
    assert "the release's token 12 (logprob -2.0000) is not among the best the process reported" in \
        (FP.mismatch(answers) or "")
    short = honest()
    short[1] = Scored([-0.7], [20], [-0.7])
    assert FP.mismatch(short) == "prompt 1: 1 positions scored where the release has 2"


def test_a_fingerprint_written_before_reads_back_and_a_malformed_one_does_not() -> None:
    doc = {"prompts": [[1, 2]], "tokens": [[3]], "logprobs": [[-0.5]], "second": [[4]], "margins": [[0.2]],
           "probe": {"texts": ["x"], "max_tokens": 1}}
    fp = Fingerprint.from_json(doc)
    assert fp is not None and fp.as_json() == {k: v for k, v in doc.items() if k != "probe"}
    assert Fingerprint.from_json({**doc, "prompts": [[]]}) is None
    assert Fingerprint.from_json({**doc, "logprobs": [[math.nan]]}) is None
    assert Fingerprint.from_json({**doc, "tokens": [[]], "logprobs": [[]], "second": [[]], "margins": [[]]}) is None


@pytest.mark.contract
def test_sglang_s_prompt_logprobs_are_read_from_the_prompt_s_last_token() -> None:
    """Against SGLang's documented shape (a scripted server): SGLang leaves the entry at logprob_start_len
    unscored, so the probe starts at the prompt's last token and reads the entries after it."""
    answer = {"text": "", "output_ids": [7], "meta_info": {
        "input_token_logprobs": [[None, 3, None], [-0.5, 10, None], [-1.0, 11, None]],
        "input_top_logprobs": [None, [[-0.5, 10, None]], [[-0.9, 30, None]]]}}

    async def main() -> tuple[Scored, dict[str, Any]]:
        runner, url, seen = await serve([answer])
        try:
            async with aiohttp.ClientSession() as session:
                got = await SGLangClient(session, url).teacher_forced([1, 2, 3], [10, 11], "r1")
                with pytest.raises(EngineError, match="could not be read"):
                    await SGLangClient(session, url).teacher_forced([1, 2, 3], [10, 12], "r1")
        finally:
            await runner.cleanup()
        return got, seen[0]

    got, sent = asyncio.run(main())
    assert got == Scored([-0.5, -1.0], [10, 30], [-0.5, -0.9])
    assert (sent["input_ids"], sent["logprob_start_len"], sent["top_logprobs_num"], sent["lora_path"]) == \
        ([1, 2, 3, 10, 11], 2, 1, "r1")
    assert sent["return_logprob"] and sent["sampling_params"]["max_new_tokens"] == 1


def test_a_vllm_answer_per_position_is_read_back_in_order() -> None:
    """vLLM's /v1/completions with one prompt per position: choice j's best two (beside the sampled token) give
    position j's best token and the logprob of the reference's token, if it is among them."""
    def choice(index: int, row: dict[int, float]) -> dict[str, Any]:
        return {"index": index, "logprobs": {"top_logprobs": [{f"token_id:{t}": lp for t, lp in row.items()}]}}

    answer = {"choices": [choice(1, {30: -0.4, 11: -0.45}), choice(0, {10: -0.5, 8: -2.0}), choice(2, {5: -0.1})]}
    assert forced(answer, [10, 11, 12]) == Scored([-0.5, -0.45, None], [10, 30, 5], [-0.5, -0.4, -0.1])
    with pytest.raises(EngineError, match="answered 3 of the probe's 2 positions"):
        forced(answer, [10, 11])
    with pytest.raises(EngineError, match="could not be read"):
        forced({"choices": [{"index": 0}]}, [10])

