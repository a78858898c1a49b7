"""The engine client's top-K capture (SGLang's `meta_info.output_top_logprobs`): full, or partial and then off,
and how compactly a record keeps it."""

from __future__ import annotations

from reefd.engines.generation import top_k_rows
from reefd.observe.recordcodec import pack, unpack
from reefd.serve.chat import Completion
from reefd.serve.turn_record import top_k_fields


def test_a_full_capture_is_k_ids_and_logprobs_per_token() -> None:
    top = [[[-0.1, 5, None], [-2.5, 9, None]], [[-0.3, 7, "x"], [-1.4, 5, None], [-3.0, 1, None]]]
    assert top_k_rows(top, tokens=2, k=2) == ([[5, 9], [7, 5]], [[-0.1, -2.5], [-0.3, -1.4]])


def test_a_partial_capture_is_refused() -> None:
    row = [[-0.1, 5, None], [-2.5, 9, None]]
    assert top_k_rows([row], tokens=2, k=2) is None  # a token without its row
    assert top_k_rows([row, row[:1]], tokens=2, k=2) is None  # a row short of K
    assert top_k_rows([row, [[None, 3, None], [-1.0, 4, None]]], tokens=2, k=2) is None  # not a logprob
    assert top_k_rows([row, "garbage"], tokens=2, k=2) is None


def test_the_record_keeps_the_capture_as_flat_arrays() -> None:
    full = Completion(text="ab", finish_reason="stop", prompt_tokens=1, completion_tokens=2,
                      completion_top_ids=[[5, 9], [7, 5]], completion_top_logprobs=[[-0.1, -2.5], [-0.3, -1.4]],
                      top_k_capture="full")
    fields = top_k_fields(full)
    assert fields == {"top_k_capture": "full", "top_k": 2, "completion_top_ids": [5, 9, 7, 5],
                      "completion_top_logprobs": [-0.1, -2.5, -0.3, -1.4]}
    partial = Completion(text="ab", finish_reason="stop", prompt_tokens=1, completion_tokens=2,
                         top_k_capture="partial")
    assert top_k_fields(partial) == {"top_k_capture": "partial"}  # the record says so; the channel is off
    assert top_k_fields(Completion(text="", finish_reason="stop", prompt_tokens=1, completion_tokens=0)) == {}
    # stored as raw arrays: 4 bytes per id and 4 per logprob (float32), not JSON floats
    k, tokens = 4, 1000
    record = {"id": "r", "completion_top_ids": [i % 49152 for i in range(k * tokens)],
              "completion_top_logprobs": [-(i % 97) / 7.0 for i in range(k * tokens)]}
    packed = pack(record)
    assert len(packed) - len(pack({"id": "r"})) == 8 * k * tokens + 2 * 5
    back = unpack(packed)
    assert back["completion_top_ids"] == record["completion_top_ids"]
    assert max(abs(a - b) for a, b in zip(back["completion_top_logprobs"], record["completion_top_logprobs"],
                                          strict=True)) < 1e-5
