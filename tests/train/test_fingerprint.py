"""The reference's fingerprint decodes every probe prompt in one batch: each prompt must get what it gets alone
(tokens, runners-up, logprobs to float rounding), whatever the other prompts' lengths, with and without an adapter.
The one-prompt decode here is written out plainly: a prefill, then a token a step on the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from reefd.train.fingerprint import cache_arg, fingerprint, greedy, load
from tests.loras import make_lora

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21, make_lora

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog, and then", "def f(n):\n    return"]


@torch.inference_mode()
def alone(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], list[int]]:
    cache = {cache_arg(model): DynamicCache()}
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, **cache)
    tokens: list[int] = []
    logprobs: list[float] = []
    second: list[int] = []
    for _ in range(max_tokens):
        top = torch.topk(out.logits[0, -1].float().log_softmax(-1), 2)
        tokens.append(int(top.indices[0]))
        logprobs.append(float(top.values[0]))
        second.append(int(top.indices[1]))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
    return tokens, logprobs, second


@pytest.mark.parametrize("with_adapter", [False, True])
def test_a_batched_probe_answers_each_prompt_as_alone(tiny_model: Path, tmp_path: Path, with_adapter: bool) -> None:
    adapter = make_lora(tiny_model, tmp_path / "lora", seed=3) if with_adapter else None
    model = load(tiny_model, adapter)
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # every row padded differently
    rows = greedy(model, prompts, 6)
    for prompt, (tokens, logprobs, second, margins) in zip(prompts, rows, strict=True):
        want_tokens, want_logprobs, want_second = alone(model, prompt, 6)
        assert tokens == want_tokens and second == want_second
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        assert all(m >= 0 for m in margins) and len(margins) == 6


def test_the_fingerprint_names_each_prompt_and_differs_with_the_adapter(tiny_model: Path, tmp_path: Path) -> None:
    base = fingerprint(tiny_model, None, TEXTS, 4)
    tuned = fingerprint(tiny_model, make_lora(tiny_model, tmp_path / "lora", seed=3, scale=2.0), TEXTS, 4)
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert base["prompts"] == tuned["prompts"] == [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    assert [len(r) for r in base["tokens"]] == [4, 4, 4]
    assert base["logprobs"] != tuned["logprobs"]
