"""SAO's DIS loss, GAE on the critic's values, the GRPO control and the critic's update, checked
against numbers worked out by hand (written out below, never recomputed with the same formula)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from recipes.sao.critic import ValueHead, critic_update, explained_variance, load_critic, save_critic, value_loss
from recipes.sao.loss import (
    dis_weights,
    gae_advantages,
    group_advantages,
    length_adaptive_lambda,
    policy_loss,
    whiten,
)

LN2, LN1_2 = math.log(2.0), math.log(1.2)


def _row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four completion tokens: r = 1.0 (in band), 0.5 (below 1 - 0.3), 1.2, and a null rollout logprob."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0 + LN2, -0.5 - LN1_2, 0.0]])
    valid = torch.tensor([[True, True, True, False]])
    advantages = torch.tensor([[2.0, 2.0, -1.0, 5.0]])
    return logp, rollout, valid, advantages


def test_dis_loss_value_and_gradient() -> None:
    logp, rollout, valid, adv = _row()
    loss, stats = policy_loss(logp, rollout, adv, valid, eps_low=0.3, eps_high=5.0)
    # in band: token 0 (w 1.0, A 2, log p -1) and token 2 (w 1.2, A -1, log p -0.5); 3 valid tokens
    # L = -(1.0*2*(-1) + 1.2*(-1)*(-0.5)) / 3 = -(-2 + 0.6) / 3 = 0.466667
    assert loss.item() == pytest.approx(0.466667, abs=1e-5)
    loss.backward()
    assert logp.grad is not None
    # dL/dlogp = -w*A/3: [-2/3, 0 (out of band), +0.4, 0 (null logprob)]
    assert logp.grad.tolist()[0] == pytest.approx([-0.666667, 0.0, 0.4, 0.0], abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["valid_tokens"] == 3.0


def test_tokens_above_the_band_give_no_gradient() -> None:
    logp, rollout, valid, adv = _row()
    loss, stats = policy_loss(logp, rollout, adv, valid, eps_low=0.3, eps_high=0.1)  # r = 1.2 is now outside
    # only token 0 is left: L = -(1.0*2*(-1)) / 3 = 0.666667; the denominator still counts all 3 valid tokens
    assert loss.item() == pytest.approx(0.666667, abs=1e-5)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-0.666667, 0.0, 0.0, 0.0], abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_band_ignores_the_sign_of_the_advantage() -> None:
    """Unlike PPO's min(), a token outside the band is dropped for positive and negative A alike."""
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0 - LN2, -1.0 - LN2]])  # r = 2 for both
    loss, _ = policy_loss(logp, rollout, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.2, 0.28)
    loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == [[0.0, 0.0]]


def test_weights_are_detached_ratios() -> None:
    logp, rollout, valid, _ = _row()
    weights, in_band = dis_weights(logp, rollout, valid, 0.3, 5.0)
    assert not weights.requires_grad
    assert weights.tolist()[0] == pytest.approx([1.0, 0.0, 1.2, 0.0], abs=1e-5)
    assert in_band.tolist() == [[True, False, True, False]]


def test_no_valid_token_means_zero_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.bool), 0.3, 5.0)
    assert loss.item() == 0.0 and stats["clip_frac"] == 0.0


def test_gae_with_the_reward_on_the_last_token() -> None:
    values = torch.tensor([[0.5, 0.1, 0.3], [0.0, 0.5, 9.9]])  # row 2 has 2 tokens; 9.9 is padding
    rewards = torch.tensor([1.0, 0.0])
    lengths = torch.tensor([3, 2])
    # row 1, lambda 0.5: delta = [0.1-0.5, 0.3-0.1, 1-0.3] = [-0.4, 0.2, 0.7]
    #   A2 = 0.7, A1 = 0.2 + 0.5*0.7 = 0.55, A0 = -0.4 + 0.5*0.55 = -0.125
    # row 2, lambda 1: A1 = 0 - 0.5 = -0.5, A0 = (0.5 - 0) + (-0.5) = 0, padding 0
    adv = gae_advantages(values, rewards, lengths, torch.tensor([0.5, 1.0]))
    assert adv.tolist()[0] == pytest.approx([-0.125, 0.55, 0.7], abs=1e-6)
    assert adv.tolist()[1] == pytest.approx([0.0, -0.5, 0.0], abs=1e-6)


def test_gae_lambda_one_is_reward_minus_value() -> None:
    values = torch.tensor([[0.5, 0.1, 0.3]])
    adv = gae_advantages(values, torch.tensor([1.0]), torch.tensor([3]), torch.tensor([1.0]))
    assert adv.tolist()[0] == pytest.approx([0.5, 0.9, 0.7], abs=1e-6)


def test_length_adaptive_lambda() -> None:
    # 1 - 1/(1.5*3) = 1 - 1/4.5 = 0.777778; 1 - 1/(1.5*10) = 1 - 1/15 = 0.933333; length 0 clamps at 0
    lam = length_adaptive_lambda(torch.tensor([3, 10, 0]), alpha=1.5)
    assert lam.tolist() == pytest.approx([0.777778, 0.933333, 0.0], abs=1e-6)


def test_group_advantages() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 3.0, 1.0, 2.0]
    groups = ["a", "a", "a", "a", "solo", "b", "b", "b"]
    adv = group_advantages(rewards, groups, eps=1e-6)
    # a: mean 0.5, std 0.5 -> [1, -1, -1, 1]; solo: std 0 -> 0
    # b: mean 2, std sqrt(2/3) = 0.816497 -> [1/0.816497, -1/0.816497, 0] = [1.224745, -1.224745, 0]
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.0, 1.224745, -1.224745, 0.0], abs=1e-5)


def test_whiten_over_masked_tokens() -> None:
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    # mean 2, std 1 over the two masked tokens; the third is zeroed
    assert whiten(adv, mask).tolist()[0] == pytest.approx([-1.0, 1.0, 0.0], abs=1e-6)


def test_critic_update_moves_the_value_toward_the_reward() -> None:
    head = ValueHead(4, init_value=0.5)
    hidden = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    target, mask = torch.tensor([[1.0]]), torch.tensor([[True]])
    opt = torch.optim.AdamW(head.parameters(), lr=0.1, weight_decay=0.0)
    losses = critic_update(head, opt, hidden, target, mask, updates=2)
    # losses before each step: (0.5-1)^2 = 0.25, then (0.7-1)^2 = 0.09
    assert losses == pytest.approx([0.25, 0.09], abs=1e-6)
    # Adam's first step moves the bias and w0 (grad -1 each) by lr = 0.1: V = 0.5 + 0.1 + 0.1 = 0.7.
    # Second step, g = 2*(0.7-1) = -0.6: m = 0.9*-0.1 + 0.1*-0.6 = -0.15, m^ = -0.15/0.19 = -0.789474;
    # v = 0.999*0.001 + 0.001*0.36 = 0.001359, v^ = 0.001359/0.001999 = 0.679840, sqrt = 0.824524;
    # each of the two parameters moves 0.1*0.789474/0.824524 = 0.095749: V = 0.7 + 2*0.095749 = 0.891498
    assert head(hidden).item() == pytest.approx(0.891498, abs=1e-5)
    assert head.linear.weight.tolist()[0][1:] == [0.0, 0.0, 0.0]  # features that are 0 got no update


def test_value_loss_and_explained_variance() -> None:
    values = torch.tensor([[0.5, 0.5], [0.25, 9.0]])
    targets = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # errors^2 over 3 tokens: 0.25, 0.25, 0.0625 -> 0.5625 / 3 = 0.1875
    assert float(value_loss(values, targets, mask)) == pytest.approx(0.1875)
    # targets [1, 1, 0]: var 2/9; residuals [0.5, 0.5, -0.25]: mean 0.25, var (0.0625*2 + 0.25)/3 = 0.125
    # EV = 1 - 0.125 / (2/9) = 1 - 0.5625 = 0.4375
    assert explained_variance(values, targets, mask) == pytest.approx(0.4375)
    assert explained_variance(values, torch.ones(2, 2), mask) is None


def test_critic_file_round_trip(tmp_path: Path) -> None:
    head = ValueHead(3, init_value=0.25)
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
    save_critic(head, tmp_path / "critic.safetensors", updates=6)
    again, updates = load_critic(tmp_path / "critic.safetensors", 3)
    assert updates == 6
    assert again.linear.weight.tolist() == [[1.0, -2.0, 0.5]] and again.linear.bias.tolist() == [0.25]
    with pytest.raises(ValueError, match="hidden size 4"):
        load_critic(tmp_path / "critic.safetensors", 4)
