"""TTT-Discover's trainer objective on a hand-worked two-sample example: the importance-sampling loss summed over
tokens with no clip, and the centered KL penalty folded into the advantages (numbers written out, not recomputed
with the same code)."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.ttt_discover.objective import TTTObjective, TTTSettings
from reefd.train.batch import Batch, collate
from reefd.train.objective import Context, Outputs
from reefd.train.spec import Rollout


def setup(kl_coef: float, base: list[list[float]]) -> tuple[TTTObjective, Batch]:
    # sample 0: two tokens, sampled at logp -1, -2, advantage +2; sample 1: one token at -0.5, advantage -1
    samples = [Rollout([5], [1, 2], [-1.0, -2.0], 0.0, "0/0", "A", extra={"advantage": 2.0, "beta": 1.0}),
               Rollout([5], [3], [-0.5], 0.0, "0/0", "B", extra={"advantage": -1.0, "beta": 1.0})]
    batch = collate(samples, [0, 1], 0)

    def reference(b: Batch, own_top: int = 0) -> Outputs:
        return Outputs(torch.tensor(base), torch.zeros(2, 2, 1))

    obj = TTTObjective(TTTSettings(kl_coef=kl_coef), Context(samples, 1, None, None, reference))
    return obj, batch


def test_without_kl_the_loss_is_minus_the_ratio_weighted_advantages_summed_over_tokens() -> None:
    obj, batch = setup(0.0, [[0.0, 0.0], [0.0, 0.0]])
    # the policy now gives token logps -1+ln2, -2, -0.5 (ratios 2, 1, 1; the padding column is ignored)
    logp = torch.tensor([[-1.0 + math.log(2.0), -2.0], [-0.5, -9.0]], requires_grad=True)
    loss, stats = obj.loss(batch, Outputs(logp, torch.zeros(2, 2, 1)))
    # -(2·2 + 1·2 + 1·(-1)) = -5: no clip even at ratio 2, summed (not averaged) over tokens
    assert float(loss.detach()) == pytest.approx(-5.0)
    loss.backward()
    assert logp.grad is not None
    grad = logp.grad.tolist()
    assert grad[0] == pytest.approx([-4.0, -2.0]) and grad[1] == pytest.approx([1.0, 0.0])  # -ratio·A
    assert stats["ratio"] == pytest.approx(4 / 3)


def test_the_centered_kl_penalty_shifts_each_tokens_advantage() -> None:
    # d = sampled - base: [-1 - (-1.5), -2 - (-1)] = [0.5, -1]; [-0.5 - (-0.5)] = [0]; mean d = -1/6
    obj, batch = setup(0.1, [[-1.5, -1.0], [-0.5, 0.0]])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)  # ratio 1 everywhere
    adv, _, diff = obj.terms(batch, Outputs(logp, torch.zeros(2, 2, 1)))
    mean = -1 / 6
    assert diff.tolist()[0] == pytest.approx([0.5, -1.0]) and diff.tolist()[1][0] == pytest.approx(0.0)
    assert adv.tolist()[0] == pytest.approx([2 + 0.1 * (mean - 0.5), 2 + 0.1 * (mean + 1.0)])
    assert adv.tolist()[1] == pytest.approx([-1 + 0.1 * mean, 0.0])  # padding gets no advantage
    loss, stats = obj.loss(batch, Outputs(logp, torch.zeros(2, 2, 1)))
    # the penalty is centered: at ratio 1 it sums to zero over the grid, so the loss is -(2 + 2 - 1) = -3
    assert float(loss.detach()) == pytest.approx(-3.0)
    assert stats["kl"] == pytest.approx(mean)


def test_a_sample_without_an_advantage_is_refused() -> None:
    samples = [Rollout([5], [1], [-1.0], 0.0, extra={"beta": 1.0})]
    with pytest.raises(ValueError, match=r"samples\[0\].extra.advantage"):
        TTTObjective(TTTSettings(), Context(samples, 1, None))
