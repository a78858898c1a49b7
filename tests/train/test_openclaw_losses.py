"""OpenClaw-RL's two terms on a two-token example, checked against numbers worked out by hand (written out below,
never recomputed with the same formula), and the objective's wiring of them (which term trains which turn)."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.openclaw_rl.loss import opd_terms, pg_terms, sample_mean
from recipes.openclaw_rl.objective import OpenClawObjective, OpenClawSettings, with_hint
from reefd.train.batch import collate
from reefd.train.objective import Context, Outputs
from reefd.train.spec import Rollout

LN = math.log


def test_pg_term_at_ratio_one_is_minus_the_verdict_per_token() -> None:
    # two tokens, verdict +1, old = current: ρ = 1 inside [0.8, 1.28], so L_t = -A = -1; mean over 2 tokens = -1
    logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True]])
    terms = pg_terms(logp, logp.detach(), torch.tensor([1.0]), mask)
    assert terms.tolist() == [[-1.0, -1.0]]
    loss = sample_mean(terms, mask).sum()
    loss.backward()
    # dL/dlogp_t = -A * ρ / 2 = -0.5 for each token
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])


def test_pg_term_clips_at_one_plus_eps_high_and_one_minus_eps() -> None:
    # token 0: ρ = 1.5 with A = +1 → min(1.5, 1.28) → L = -1.28, no gradient (clipped)
    # token 1: ρ = 0.5 with A = +1 → max(-0.5, -0.8) = -0.5, gradient -ρ = -0.5 (unclipped side)
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[LN(1.5), LN(0.5)]], requires_grad=True)
    mask = torch.tensor([[True, True]])
    terms = pg_terms(logp, old, torch.tensor([1.0]), mask)
    assert terms[0].tolist() == pytest.approx([-1.28, -0.5])
    terms.sum().backward()
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([0.0, -0.5])
    # negative verdict, ρ = 0.5: max(+0.5, +0.8) = 0.8 (clipped at 1 - eps), no gradient
    logp2 = torch.tensor([[LN(0.5), 0.0]], requires_grad=True)
    terms2 = pg_terms(logp2, old, torch.tensor([-1.0]), torch.tensor([[True, False]]))
    assert terms2[0].tolist() == pytest.approx([0.8, 0.0])


def test_pg_log_ratio_is_clamped_to_twenty_before_exp() -> None:
    # logp - old = 50 → clamped to 20: ρ = e^20 (finite), and with A = -1, max(e^20, 1.28) = e^20
    terms = pg_terms(torch.tensor([[0.0]]), torch.tensor([[-50.0]]), torch.tensor([-1.0]), torch.tensor([[True]]))
    assert terms.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_opd_term_by_hand() -> None:
    # K = 2. Token 0: old p over the set = (0.75, 0.25) → weights (0.75, 0.25) (softmax of old log p over the set);
    #   teacher (0.5, 0.5): diff = (ln(0.5/0.75), ln(0.5/0.25)) = (-0.405465, 0.693147), both inside ±1.
    #   A = (0.75 * -0.405465, 0.25 * 0.693147) = (-0.304099, 0.173287); at ρ = 1: L_0 = -(A_0 + A_1) = 0.130812
    # Token 1: old (0.6, 0.1) → weights (6/7, 1/7) = (0.857143, 0.142857); teacher (0.6 e^3, 0.1 e^-3):
    #   diff = (3, -3) → clipped to (1, -1); A = (0.857143, -0.142857); L_1 = -(0.857143 - 0.142857) = -0.714286
    old = torch.log(torch.tensor([[[0.75, 0.25], [0.6, 0.1]]]))
    teacher = torch.log(torch.tensor([[[0.5, 0.5], [0.6 * math.e ** 3, 0.1 * math.e ** -3]]]))
    top = old.clone().requires_grad_(True)
    mask = torch.tensor([[True, True]])
    terms, adv = opd_terms(top, old, teacher, mask)
    assert adv[0, 0].tolist() == pytest.approx([-0.304099, 0.173287], abs=1e-5)
    assert adv[0, 1].tolist() == pytest.approx([0.857143, -0.142857], abs=1e-5)
    assert terms[0].tolist() == pytest.approx([0.130812, -0.714286], abs=1e-5)
    # summed over the set, not averaged: the per-sample mean over 2 tokens is (0.130812 - 0.714286) / 2
    assert sample_mean(terms, mask).item() == pytest.approx(-0.291737, abs=1e-5)
    terms.sum().backward()
    # at ρ = 1 (inside the band) dL/dℓ_v = -A_v
    assert top.grad is not None
    assert top.grad[0, 0].tolist() == pytest.approx([0.304099, -0.173287], abs=1e-5)
    assert top.grad[0, 1].tolist() == pytest.approx([-0.857143, 0.142857], abs=1e-5)


def test_masked_tokens_give_nothing() -> None:
    old = torch.zeros((1, 2, 2))
    terms, _ = opd_terms(old.clone(), old, old + 1.0, torch.tensor([[True, False]]))
    assert terms[0, 1].item() == 0.0 and terms[0, 0].item() != 0.0
    assert pg_terms(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
                    torch.tensor([[False, False]])).tolist() == [[0.0, 0.0]]


def test_hint_goes_on_the_last_user_message() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "second"},
                {"role": "tool", "content": "t"}]
    out = with_hint(messages, "Start with OK:")
    assert out[3]["content"] == "second\n\n[Hint] Start with OK:" and out[1]["content"] == "first"
    assert messages[3]["content"] == "second"  # the record's messages are not changed
    parts = with_hint([{"role": "user", "content": [{"type": "text", "text": "q"}]}], "h")
    assert parts[0]["content"][-1] == {"type": "text", "text": "[Hint] h"}


def _objective(samples: list[Rollout], teacher_top: torch.Tensor) -> OpenClawObjective:
    """The objective with a stand-in reference model whose top-K log-probs are `teacher_top`."""
    def reference(batch):  # type: ignore[no-untyped-def]
        return Outputs(torch.zeros(batch.completion.shape), torch.zeros((*batch.completion.shape, 1)),
                       teacher_top[: len(batch.index)])

    obj = OpenClawObjective(OpenClawSettings(), Context(samples, 1, None, None, reference))
    obj.teachers = {i: s.prompt_ids for i, s in enumerate(samples) if (s.extra or {}).get("opd")}
    return obj


def test_each_turn_trains_only_the_terms_it_has() -> None:
    # sample 0: verdict -1, no hint → RL only; sample 1: hint, verdict 0 → OPD only
    samples = [Rollout([1, 2], [3, 4], [-1.0, -1.0], -1.0, top_ids=[[3, 5], [4, 6]],
                       extra={"rl": True, "opd": False}),
               Rollout([1, 2], [3, 4], [-1.0, -1.0], 0.0, top_ids=[[3, 5], [4, 6]],
                       extra={"rl": False, "opd": True})]
    old_top = torch.log(torch.tensor([[[0.75, 0.25], [0.6, 0.1]]] * 2))
    teacher = torch.log(torch.tensor([[[0.5, 0.5], [0.6 * math.e ** 3, 0.1 * math.e ** -3]]]))
    obj = _objective(samples, teacher)
    batch = collate(samples, [0, 1], pad_id=0)
    logp = torch.tensor([[-0.5, -2.0], [-0.5, -2.0]], requires_grad=True)
    top = old_top.clone().requires_grad_(True)
    loss, stats = obj.loss(batch, Outputs(logp, torch.zeros(2, 2, 1), top))
    # RL: sample 0's mean over tokens = -A = +1, over n = 2 samples: 0.5; OPD: sample 1's mean -0.291737 / 2
    assert stats["pg_loss"] == pytest.approx(1.0) and stats["opd_loss"] == pytest.approx(-0.291737, abs=1e-5)
    assert loss.item() == pytest.approx(0.5 - 0.291737 / 2, abs=1e-5)
    loss.backward()
    assert logp.grad is not None and logp.grad[1].abs().sum().item() == 0.0  # sample 1 has no RL term
    assert top.grad is not None and top.grad[0].abs().sum().item() == 0.0  # sample 0 has no OPD term
    assert logp.grad[0].tolist() == pytest.approx([0.25, 0.25])  # -A ρ / (2 tokens · 2 samples), A = -1
    assert obj.metrics()["rl_samples"] == 1 and obj.metrics()["opd_samples"] == 1


def test_the_union_set_adds_the_teachers_own_top_ids() -> None:
    """opd_set: union widens each OPD sample's engine top-K with the hinted teacher's own most likely ids that are
    not in it (K more, best first); a sample the teacher cannot score keeps no set, an RL-only one stays as is."""
    samples = [Rollout([1, 2], [3, 4], [-1.0, -1.0], 0.0, top_ids=[[3, 5], [4, 6]], extra={"opd": True}),
               Rollout([1, 2], [3, 4], [-1.0, -1.0], 1.0, extra={"rl": True}),
               Rollout([1, 2], [3, 4], [-1.0, -1.0], 0.0, top_ids=[[3, 5], [4, 6]], extra={"opd": True})]
    asked = []

    def reference(batch, own_top=0):  # type: ignore[no-untyped-def]
        asked.append(own_top)
        own = torch.tensor([[[5, 7, 9, 3], [8, 4, 1, 2]]] * len(batch.index))
        return Outputs(torch.zeros(batch.completion.shape), torch.zeros((*batch.completion.shape, 1)), None, own)

    ctx = Context(samples, 1, None, None, reference)
    obj = OpenClawObjective(OpenClawSettings(), ctx)  # no base model here: the teacher prompts are set below
    obj.teachers = {0: [1, 2]}  # sample 2's prompt did not render back: no teacher
    obj._widen(ctx)
    assert asked == [4]  # 2K of the teacher's own, to find K new ones
    assert ctx.samples[0].top_ids == [[3, 5, 7, 9], [4, 6, 8, 1]]
    assert ctx.samples[1].top_ids is None and ctx.samples[2].top_ids is None
    batch = collate(ctx.samples, [0, 1, 2], pad_id=0)  # one width for the whole batch
    assert batch.top_ids is not None and batch.top_ids.shape == (3, 2, 4)
