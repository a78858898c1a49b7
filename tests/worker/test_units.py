"""Pure units of the worker: request validation, stop strings, sampling, KV-cache row surgery."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from reefd.worker import kvcache
from reefd.worker.detok import TextTracker, held_back
from reefd.worker.openai_chat import _streamable, parse_tool_calls
from reefd.worker.params import BadRequest, SamplingParams, parse_generate, parse_sampling
from reefd.worker.sampling import draw_uniforms, sample, top_logprobs

# ---- params ----------------------------------------------------------------------------


def test_parse_generate_defaults_and_aliases() -> None:
    req = parse_generate({"input_ids": [1, 2], "sampling_params": {"seed": 5, "stop": "\n\n", "top_k": 0}})
    assert req.input_ids == [1, 2] and req.text is None
    assert req.sampling.seed == 5
    assert req.sampling.stop == ("\n\n",)
    assert req.sampling.top_k == -1
    assert req.sampling.max_new_tokens == 128
    assert req.logprob_start_len == -1 and not req.stream and req.rid


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "JSON object"),
        ({}, "exactly one of"),
        ({"input_ids": [1], "text": "x"}, "exactly one of"),
        ({"input_ids": []}, "must not be empty"),
        ({"input_ids": [1, "2"]}, "list of integers"),
        ({"text": ["a", "b"]}, "non-empty string"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "x", "sampling_params": {"frobnicate": 1}}, "unknown sampling parameter"),
        ({"text": "x", "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
        ({"text": "x", "sampling_params": {"stop": [""]}}, "stop"),
        ({"text": "x", "sampling_params": {"sampling_seed": 1.5}}, "sampling_seed"),
        ({"text": "x", "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "x", "stream": "yes"}, "booleans"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": "x"}, "top_logprobs_num"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 2.0}, "top_logprobs_num"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": True}, "top_logprobs_num"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ],
)
def test_parse_generate_refuses(body: object, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_generate(body)


def test_top_logprobs_num_counts_only_with_return_logprob() -> None:
    assert parse_generate({"text": "x"}).top_logprobs_num == 0
    assert parse_generate({"text": "x", "return_logprob": True, "top_logprobs_num": 20}).top_logprobs_num == 20
    assert parse_generate({"text": "x", "return_logprob": True, "top_logprobs_num": None}).top_logprobs_num == 0
    assert parse_generate({"text": "x", "top_logprobs_num": 5}).top_logprobs_num == 0  # SGLang: no logprob fields


def test_neutral_values_of_unsupported_params_are_accepted() -> None:
    sp = parse_sampling({"frequency_penalty": 0.0, "repetition_penalty": 1.0, "n": 1, "skip_special_tokens": True})
    assert sp == SamplingParams()


# ---- text and stop strings -------------------------------------------------------------


def test_held_back_is_the_longest_partial_stop() -> None:
    assert held_back("abc END", ["END!"]) == 3
    assert held_back("abc E", ["END", "EX"]) == 1
    assert held_back("abc", ["xyz"]) == 0


def test_tracker_trims_at_the_earliest_stop() -> None:
    pieces = ["Hel", "lo", " wor", "ld", "!!"]
    tracker = TextTracker(lambda ids: "".join(pieces[i] for i in ids), ["world", "lo w"])
    assert tracker.update([0]) is None
    assert tracker.update([0, 1]) is None
    assert tracker.take() == "Hel"  # "lo" may start "lo w"
    assert tracker.update([0, 1, 2]) == "lo w"
    assert tracker.text == "Hel"
    assert tracker.rest() == ""


def test_tracker_hides_a_half_character_until_the_next_token_completes_it() -> None:
    pieces = {1: "ab", 2: "\ufffd", 3: "c"}  # 2+3 together render "é"

    def decode(ids: list[int]) -> str:
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdc", "é")

    tracker = TextTracker(decode, [])
    tracker.update([1, 2])
    assert tracker.take() == ""  # the piece ends in half a character: it waits
    tracker.update([1, 2, 3])
    assert tracker.take() == "abé"
    tracker.update([1, 2, 3, 2], final=True)  # an answer that ends mid-character keeps what the model wrote
    assert tracker.rest() == "\ufffd"


def test_incremental_decoding_matches_a_full_decode(tiny_model: Any) -> None:
    """The pieces the tracker decodes concatenate to the whole answer's decode, with the tiny model's real
    tokenizer, over random ids (half characters, special tokens) and multilingual text."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)

    def decode(ids: Any) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    rng = random.Random(7)
    samples = [[rng.randrange(tokenizer.vocab_size) for _ in range(200)] for _ in range(20)]
    samples += [tokenizer.encode("naïve café — 日本語 🙂 " * 5 + "def f(x):\n    return x\n")]
    for ids in samples:
        tracker = TextTracker(decode, [])
        streamed = ""
        for n in range(1, len(ids) + 1):
            tracker.update(ids[:n], final=n == len(ids))
            streamed += tracker.take() if n < len(ids) else tracker.rest()
        assert streamed == tracker.text == decode(ids)


def test_parse_tool_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


# ---- sampling --------------------------------------------------------------------------


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingParams(temperature=0.0)] * 4
    tokens, logprobs = sample(logits, rows, torch.rand(4))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, expected)


def test_logprob_ignores_temperature_and_filters() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    rows = [SamplingParams(temperature=0.3, top_k=5, top_p=0.5)]
    token, logprob = sample(logits, rows, torch.tensor([0.7]))
    assert math.isclose(logprob.item(), logits.log_softmax(-1)[0, token.item()].item(), rel_tol=1e-6)


def test_top_logprobs_are_each_rows_best_raw_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    tops = top_logprobs(logits, [2, 0, 5])
    assert tops[1] is None
    for row, k in ((0, 2), (2, 5)):
        entries = tops[row]
        assert entries is not None and len(entries) == k
        values, ids = logits[row].log_softmax(-1).topk(k)
        assert [t for _, t, _ in entries] == ids.tolist()
        assert [v for v, _, _ in entries] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(extra is None for _, _, extra in entries)
    assert top_logprobs(logits, [0, 0, 0]) == [None, None, None]
    assert len(top_logprobs(logits[:1], [80])[0] or []) == 50  # capped at the vocabulary


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    tokens, _ = sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 3, torch.rand(3))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        sample(logits, [SamplingParams(top_p=0.7)], torch.tensor([u]))[0].item() for u in torch.linspace(0, 0.999, 50)
    }
    assert seen == {0, 1}


def test_a_row_depends_only_on_its_own_draw() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=gen)
    rows = [SamplingParams(temperature=1.0)] * 5
    alone = [sample(logits[i : i + 1], rows[:1], torch.tensor([0.25 * i]))[0].item() for i in range(4)]
    batched = sample(logits[:4], rows[:4], torch.tensor([0.0, 0.25, 0.5, 0.75]))[0].tolist()
    assert alone == batched


def test_draw_uniforms_follow_each_seed() -> None:
    a = draw_uniforms([torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)])
    b = draw_uniforms([torch.Generator().manual_seed(8), torch.Generator().manual_seed(7)])
    assert a.tolist() == b.flip(0).tolist()


# ---- kv cache rows ---------------------------------------------------------------------


def test_merge_pads_left_and_select_trims_shared_padding() -> None:
    a = [(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))]
    b = [(torch.full((1, 1, 5, 4), 2.0), torch.full((1, 1, 5, 4), 2.0))]
    mask_a = torch.tensor([[0, 1, 1], [1, 1, 1]])
    mask_b = torch.ones(1, 5, dtype=torch.long)
    kv, mask = kvcache.merge(a, mask_a, b, mask_b)
    assert mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert kv[0][0].shape == (3, 1, 5, 4)
    assert kv[0][0][0, 0, :2].abs().sum() == 0
    kv, mask = kvcache.select(kv, mask, [0, 1])
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert kv[0][1].shape == (2, 1, 3, 4)


def test_streamed_content_stops_before_a_tool_call() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert _streamable("Sure. <tool_", final=False, tools=True) == "Sure. "
    assert _streamable("Sure. " + call, final=True, tools=True) == "Sure. "
    assert _streamable("Sure. <tool_call>oops", final=True, tools=True) == "Sure. <tool_call>oops"
    assert _streamable("Sure. <tool_", final=False, tools=False) == "Sure. <tool_"


def test_a_growing_cache_layer_writes_in_place_and_matches_concatenation() -> None:
    """A decode step writes one column into spare room instead of copying the whole cache (transformers'
    DynamicLayer concatenates, which makes time per token grow with the answer)."""
    layer = kvcache.GrowingLayer()
    torch.manual_seed(0)
    keys, values = torch.randn(2, 4, 300, 8), torch.randn(2, 4, 300, 8)
    out_k, out_v = layer.update(keys, values)
    assert torch.equal(out_k, keys) and torch.equal(out_v, values)
    moves = 0
    for _ in range(2000):
        k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
        before = layer.keys.data_ptr()
        out_k, out_v = layer.update(k, v)
        moves += out_k.data_ptr() != before
        keys, values = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
    assert torch.equal(out_k, keys) and torch.equal(out_v, values)
    assert layer.get_seq_length() == 2300
    assert moves <= 6  # the buffer grows by half again each time it fills: a handful of copies, not 2000
    layer.crop(-100)  # transformers may replace the tensors: the layer adopts them
    out_k, _ = layer.update(k, v)
    assert torch.equal(out_k, torch.cat([keys[..., :2200, :], k], dim=-2))
