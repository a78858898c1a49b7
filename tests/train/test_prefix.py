"""A micro-batch's shared opening runs once (reefd/train/prefix.py): the policy's log-probs, hidden states and LoRA
gradient must be the plain forward's, whatever the rows' prompt and completion lengths, for the policy and for its
frozen reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from reefd.train import prefix
from reefd.train.batch import Batch, collate
from reefd.train.spec import LoraSpec, OptimSpec, Rollout, TrainSpec
from reefd.train.training import Policy
from tests.loras import make_lora

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21, make_lora

OPENING = "You are a careful assistant. Answer the question that follows with a number only. Question:"


def samples(tiny_model: Path) -> list[Rollout]:
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    head = list(tok.encode(OPENING, add_special_tokens=False))
    rows = []
    for i, (question, answer) in enumerate([("what is 2 + 2?", " 4"), ("7 + 8?", " it is 15, since 7 + 8 = 15"),
                                            ("what is 9 + 0? Think.", " 9"), ("1 + 1", " two")]):
        prompt, completion = head + tok.encode(" " + question, add_special_tokens=False), \
            tok.encode(answer, add_special_tokens=False)
        rows.append(Rollout(prompt, completion, [-1.0] * len(completion), float(i % 2)))
    return rows


def policy(tiny_model: Path, tmp_path: Path, rows: list[Rollout]) -> Policy:
    adapter = make_lora(tiny_model, tmp_path / "lora", seed=5, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return Policy(TrainSpec(job="j", objective="x:Y", settings={}, base_model=tiny_model, init_adapter=adapter,
                            output_dir=tmp_path / "out", samples=rows, lora=LoraSpec(), optim=OptimSpec()))


def run(p: Policy, batch: Batch, shared: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    monkeypatch.setattr(prefix, "MIN_SHARED", 1 if shared else 10**9)
    p.model.zero_grad(set_to_none=True)
    out = p.forward(batch)
    (out.logp * batch.tokens).sum().backward()
    grads = torch.cat([q.grad.reshape(-1) for q in p.params])
    ref = p.reference(batch)
    return out.logp.detach(), out.hidden.detach(), grads, ref.logp


def test_the_shared_opening_runs_once_and_changes_nothing(tiny_model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rows = samples(tiny_model)
    p = policy(tiny_model, tmp_path, rows)
    batch = collate(rows, [2, 0, 3, 1], p.pad_id)
    assert len({len(r.prompt_ids) for r in rows}) > 1 and len({len(r.completion_ids) for r in rows}) > 1
    shared = prefix.shared_length(batch)
    assert shared >= len(rows[0].prompt_ids) - 8  # the whole opening, stopping within the questions' first words
    calls: list[int] = []
    decoder = p.causal_lm.get_decoder()
    handle = decoder.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]),
                                               with_kwargs=True)
    try:
        logp, hidden, grads, ref = run(p, batch, True, monkeypatch)
    finally:
        handle.remove()
    assert calls[:2] == [shared, batch.input_ids.shape[1] - shared]  # the opening once, then the rows' rests
    want_logp, want_hidden, want_grads, want_ref = run(p, batch, False, monkeypatch)
    mask = batch.tokens
    assert torch.allclose(logp[mask], want_logp[mask], atol=1e-4)
    assert torch.allclose(hidden[mask], want_hidden[mask], atol=1e-4)
    assert torch.allclose(ref[mask], want_ref[mask], atol=1e-4)
    assert not torch.allclose(ref[mask], logp[mask], atol=1e-3)  # the reference is the base model, not the policy
    assert float((grads - want_grads).norm() / want_grads.norm()) < 1e-4
    assert float(want_grads.norm()) > 0


def test_what_is_shared_stops_before_a_prediction_and_below_the_floor(tiny_model: Path) -> None:
    rows = samples(tiny_model)
    head = len(rows[0].prompt_ids) - len(AutoTokenizer.from_pretrained(tiny_model).encode(" what is 2 + 2?"))
    one = collate(rows, [0], 0)
    assert prefix.shared_length(one) == 0  # a single row has nothing to share
    twins = collate([rows[0], rows[0]], [0, 1], 0)  # the same prompt twice: shared up to its last prompt token
    assert prefix.shared_length(twins) == len(rows[0].prompt_ids) - 1
    assert prefix.shared_length(collate(rows, [0, 1, 2, 3], 0)) >= head
    short = [Rollout([7, 8, 9], [1], [-1.0], 1.0), Rollout([7, 8, 9, 10], [2], [-1.0], 0.0)]
    assert prefix.shared_length(collate(short, [0, 1], 0)) == 0  # 2 tokens in common: below MIN_SHARED


def test_dropout_or_no_completion_runs_every_row_whole(tiny_model: Path, tmp_path: Path) -> None:
    """Dropout draws a mask per row, so an opening shared by rows would share one: a LoRA with dropout, or a config
    that sets some, runs every row whole; so does a batch with no completion token at all."""
    rows = samples(tiny_model)
    p = policy(tiny_model, tmp_path, rows)
    assert p.share_opening and prefix.shareable(p.model, p.config)
    dropped = Policy(TrainSpec(job="j", objective="x:Y", settings={}, base_model=tiny_model, init_adapter=None,
                               output_dir=tmp_path / "out2", samples=rows, lora=LoraSpec(dropout=0.1),
                               optim=OptimSpec()))
    assert not dropped.share_opening
    config = p.config.__class__.from_dict({**p.config.to_dict(), "attention_dropout": 0.1})
    assert not prefix.shareable(p.model, config)
    empty = [Rollout(r.prompt_ids, [], [], 0.0) for r in rows[:2]]
    assert prefix.shared_length(collate(empty, [0, 1], 0)) == 0
