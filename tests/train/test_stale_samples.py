"""Samples kept past a recipe's max_staleness (`stale: weight`) in the trainer: the spec's fields, the batch's stale
rows, the truncated importance weight, and what each objective does with it (SAO and GRPO: f(r) truncated at
stale_clip; OpenClaw-RL: both terms multiplied by it), checked against numbers worked out by hand."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from recipes.openclaw_rl.objective import OpenClawObjective, OpenClawSettings
from recipes.sao.loss import dis_weights, policy_loss
from recipes.sao.objective import GRPOObjective, SAOObjective, SAOSettings
from reefd.train.batch import collate, stale_weights
from reefd.train.objective import Context, Outputs
from reefd.train.spec import Rollout, SpecError, parse_spec

LN2, LN3 = math.log(2.0), math.log(3.0)


def raw_spec(tmp_path: Path, **sample: Any) -> dict[str, Any]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return {"job": "j-1", "objective": "recipes.sao.objective:SAOObjective", "base_model": str(model),
            "output_dir": str(tmp_path / "out"),
            "samples": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0], "reward": 1.0, **sample}]}


def test_spec_samples_carry_their_release_staleness_and_stale_flag(tmp_path: Path) -> None:
    spec = parse_spec(raw_spec(tmp_path, release="r2-abcdef0", staleness=3, stale=True))
    assert (spec.samples[0].release, spec.samples[0].staleness, spec.samples[0].stale) == ("r2-abcdef0", 3, True)
    spec = parse_spec(raw_spec(tmp_path, staleness=None))  # a release that is not in the chain
    assert (spec.samples[0].release, spec.samples[0].staleness, spec.samples[0].stale) == (None, None, False)
    for key, value, message in (("staleness", -1, "samples[0].staleness: -1 is not a number of releases"),
                                ("staleness", 1.5, "samples[0].staleness: 1.5 is not"),
                                ("stale", "yes", "samples[0].stale: 'yes' is not true/false"),
                                ("release", 3, "samples[0].release: expected a non-empty string")):
        with pytest.raises(SpecError, match=re.escape(message)):
            parse_spec(raw_spec(tmp_path, **{key: value}))


def test_stale_weights_truncate_the_ratio_on_stale_rows_only() -> None:
    # row 1 is stale: token 0's ratio exp(-1 - (-1 - ln 3)) = 3 is cut to 2, token 1's is 0.5, token 2 has no
    # engine logprob (weight 1); row 0 is fresh (weight 1 whatever its ratio)
    samples = [Rollout([1], [2, 3, 4], [-1.0 - LN3, -1.0, -1.0], 1.0),
               Rollout([1], [2, 3, 4], [-1.0 - LN3, -1.0 + LN2, None], 1.0, stale=True)]
    batch = collate(samples, [0, 1], pad_id=0)
    assert batch.stale is not None and batch.stale.tolist() == [False, True]
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    weights = stale_weights(batch, logp, 2.0)
    assert not weights.requires_grad
    assert weights.tolist() == [pytest.approx([1.0, 1.0, 1.0]), pytest.approx([2.0, 0.5, 1.0])]
    fresh = collate([samples[0], samples[0]], [0, 1], pad_id=0)
    assert stale_weights(fresh, logp, 2.0).tolist() == [[1.0] * 3] * 2


def test_a_stale_tokens_dis_weight_is_at_most_the_clip() -> None:
    # ratios 3 and 1.5, both inside the band (0.7, 6): f = (3, 1.5); capped at 2: (2, 1.5)
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0 - LN3, -1.0 - math.log(1.5)]])
    valid = torch.tensor([[True, True]])
    weights, _ = dis_weights(logp, rollout, valid, 0.3, 5.0)
    assert weights.tolist()[0] == pytest.approx([3.0, 1.5])
    weights, _ = dis_weights(logp, rollout, valid, 0.3, 5.0, cap=torch.tensor([[2.0]]))
    assert weights.tolist()[0] == pytest.approx([2.0, 1.5])
    # L = -(2 * 1 * (-1) + 1.5 * 1 * (-1)) / 2 = 1.75
    loss, stats = policy_loss(logp, rollout, torch.tensor([[1.0, 1.0]]), valid, 0.3, 5.0, torch.tensor([[2.0]]))
    assert loss.item() == pytest.approx(1.75) and stats["truncated_tokens"] == 1.0
    assert policy_loss(logp, rollout, torch.tensor([[1.0, 1.0]]), valid, 0.3, 5.0)[1]["truncated_tokens"] == 0.0


def grpo_loss(stale: tuple[bool, bool]) -> tuple[float, dict[str, Any]]:
    """One group: rewards 1 and 0 (advantages +1 and -1), one token each at ratio 3 to the engine's logprob."""
    samples = [Rollout([1], [2], [-1.0 - LN3], 1.0, group="g", stale=stale[0]),
               Rollout([1], [3], [-2.0 - LN3], 0.0, group="g", stale=stale[1])]
    objective = GRPOObjective(SAOSettings(), Context(samples, 1, None))
    batch = collate(samples, [0, 1], pad_id=0)
    loss, _ = objective.loss(batch, Outputs(torch.tensor([[-1.0], [-2.0]], requires_grad=True), torch.zeros(2, 1, 1)))
    return loss.item(), objective.metrics()


def test_grpo_truncates_the_ratio_of_stale_samples_only() -> None:
    # fresh: L = -(3 * 1 * (-1) + 3 * (-1) * (-2)) / 2 = -1.5
    loss, metrics = grpo_loss((False, False))
    assert loss == pytest.approx(-1.5, abs=1e-5) and "stale_truncated_frac" not in metrics
    # the first stale: its weight 3 becomes 2: L = -(2 * 1 * (-1) + 3 * (-1) * (-2)) / 2 = -2.0
    loss, metrics = grpo_loss((True, False))
    assert loss == pytest.approx(-2.0, abs=1e-5) and metrics["stale_truncated_frac"] == 1.0
    # both: L = -(-2 + 4) / 2 = -1.0
    assert grpo_loss((True, True))[0] == pytest.approx(-1.0, abs=1e-5)


def test_openclaw_multiplies_a_stale_turns_terms_by_the_truncated_ratio() -> None:
    # verdict +1, the PPO ratio to the batch's own pass is 1, so L_t = -1 per token. Stale: token 0's ratio to the
    # engine is 3 → 2, token 1's is 0.5: L = mean(-2, -0.5) = -1.25, and dL/dlogp_t = -c_t / 2 = (-1, -0.25)
    def run(stale: bool) -> tuple[float, list[float], dict[str, Any]]:
        samples = [Rollout([1, 2], [3, 4], [-0.5 - LN3, -2.0 + LN2], 1.0, stale=stale,
                           extra={"rl": True, "opd": False})]
        objective = OpenClawObjective(OpenClawSettings(), Context(samples, 1, None))
        logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
        loss, _ = objective.loss(collate(samples, [0], pad_id=0), Outputs(logp, torch.zeros(1, 2, 1)))
        loss.backward()
        assert logp.grad is not None
        return loss.item(), logp.grad[0].tolist(), objective.metrics()

    loss, grad, metrics = run(False)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx([-0.5, -0.5]) and "stale_weight" not in metrics
    loss, grad, metrics = run(True)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx([-1.0, -0.25])
    assert metrics["stale_weight"] == pytest.approx(1.25)


def test_whitening_skips_a_micro_batch_whose_answers_all_scored_the_same() -> None:
    """normalize_advantages whitens SAO's advantages, but a micro-batch of equal rewards carries no signal: its
    critic-noise advantages stay as small as they are instead of being scaled up to unit size."""
    def mean_abs_advantage(rewards: list[float]) -> float:
        samples = [Rollout([1], [2, 3, 4], [-1.0, -1.0, -1.0], r) for r in rewards]
        objective = SAOObjective(SAOSettings(normalize_advantages=True, gae_alpha=100.0), Context(samples, 4, None))
        with torch.no_grad():  # a critic that is slightly off: V = 0.01 * h + the batch mean
            objective.critic.linear.weight.copy_(torch.full((1, 4), 0.01))
        hidden = torch.randn(len(rewards), 3, 4, generator=torch.Generator().manual_seed(0))
        logp = torch.full((len(rewards), 3), -1.0, requires_grad=True)
        objective.loss(collate(samples, list(range(len(rewards))), pad_id=0), Outputs(logp, hidden))
        return float(objective.metrics()["mean_abs_advantage"])

    assert mean_abs_advantage([1.0] * 4) < 0.1  # raw: the critic's error, a few hundredths
    assert mean_abs_advantage([1.0, 0.0, 1.0, 0.0]) == pytest.approx(1.0, abs=0.1)  # whitened: unit-sized
