"""TTT-Discover's entropic advantages (recipes/ttt_discover/entropic.py) against the reference values the recipe
must reproduce, and the reason a group needs at least 3 attempts."""

from __future__ import annotations

import math

import pytest

from recipes.ttt_discover.entropic import GroupError, advantages, beta_for, kl_to_uniform


def test_one_success_among_four() -> None:
    beta, adv = advantages([0.0, 0.0, 0.0, 1.0])
    assert beta == pytest.approx(2.5532, abs=5e-4)
    assert adv == pytest.approx([-0.798, -0.798, -0.798, 11.849], abs=5e-3)
    assert kl_to_uniform([0.0, 0.0, 0.0, 1.0], beta) == pytest.approx(math.log(2), abs=1e-10)


def test_rewards_one_to_eight() -> None:
    beta, adv = advantages([float(r) for r in range(1, 9)])
    assert beta == pytest.approx(0.6722, abs=5e-4)
    assert max(adv) == pytest.approx(5.770, abs=5e-3)
    assert adv == sorted(adv)  # a better attempt never weighs less


def test_the_weights_do_not_depend_on_a_shift_of_the_rewards() -> None:
    _, a = advantages([0.0, 0.5, 2.0, 3.0])
    _, b = advantages([100.0, 100.5, 102.0, 103.0])
    assert a == pytest.approx(b, rel=1e-9)


def test_two_attempts_blow_up() -> None:
    # with k = 2 the KL only approaches log 2 as β → ∞: the bisection stops where float64 can no longer tell the
    # KL from log 2, and the better attempt's leave-one-out weight explodes (the reason a group needs 3)
    beta, adv = advantages([0.0, 1.0])
    assert beta > 30 and max(adv) > 1e12 and min(adv) == pytest.approx(-1.0)


@pytest.mark.parametrize("rewards", [[1.0], [1.0, 1.0, 1.0], [0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0]])
def test_groups_without_signal_are_refused(rewards: list[float]) -> None:
    with pytest.raises(GroupError):
        beta_for(rewards)
