"""The value encoding: exact round trips, token arrays split out, odd values kept in the JSON."""

from __future__ import annotations

import math

from reefd.observe.recordcodec import pack, unpack


def test_round_trip_is_exact_and_arrays_are_compact() -> None:
    record = {"id": "r", "messages": [{"role": "user", "content": "héllo " * 50}],
              "prompt_token_ids": list(range(300)), "completion_token_ids": [5, 6, 7],
              "completion_logprobs": [-0.125, -1e-9, -17.5]}
    packed = pack(record)
    assert unpack(packed) == record
    assert len(packed) < 300 * 4 + 400  # ids as int32, the text deflated


def test_non_finite_logprobs_survive() -> None:
    out = unpack(pack({"completion_logprobs": [-math.inf, -0.5]}))
    assert out["completion_logprobs"][0] == -math.inf


def test_values_that_are_not_arrays_stay_in_the_json() -> None:
    record = {"prompt_token_ids": None, "completion_token_ids": [1, 2.5],
              "completion_logprobs": ["x"], "other": {"k": 1}}
    assert unpack(pack(record)) == record
    huge = {"prompt_token_ids": [2**40]}
    assert unpack(pack(huge)) == huge
