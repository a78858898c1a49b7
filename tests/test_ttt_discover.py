"""TTT-Discover's daemon side: the PUCT archive (scores, lineages, visits, persistence) and the recipe's grid ->
trainer job (entropic advantages per group, equal groups skipped, one Adam step)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from recipes.ttt_discover.archive import ROOT, Archive
from recipes.ttt_discover.recipe import TTTConfig, TTTDiscover
from reefd.grow.recipes import RecipeError, build


def child(cid: str, parent: str, score: float, step: int = 0, state: str | None = None) -> dict[str, Any]:
    return {"id": cid, "state": state or f"state {cid}", "score": score, "parent": parent, "step": step}


def test_puct_scores_follow_the_formula() -> None:
    a = Archive("start", None)
    a.expand([ROOT, ROOT], [child("a", ROOT, 1.0), child("b", ROOT, 3.0), child("c", ROOT, 2.0)])
    ranked = {s.node.id: s for s in a.puct(c=1.0)}
    # T = 2 groups expanded; root visited twice; scale = 3 - 1; rank prior over 4 states: b 4, c 3, a 2, root 1
    scale, growth = 2.0, math.sqrt(1 + 2)
    assert ranked["b"].prior == pytest.approx(4 / 10) and ranked["root"].prior == pytest.approx(1 / 10)
    assert ranked["b"].score == pytest.approx(3.0 + 1.0 * scale * 0.4 * growth / 1)
    assert ranked["a"].score == pytest.approx(1.0 + scale * 0.2 * growth)
    assert ranked["root"].q == 3.0  # its best child's value
    assert ranked["root"].score == pytest.approx(3.0 + scale * 0.1 * growth / (1 + 2))
    assert a.puct(c=1.0)[0].node.id == "b"


def test_selection_takes_one_state_per_lineage_then_repeats_the_best() -> None:
    a = Archive("start", None)
    a.expand([ROOT], [child("a", ROOT, 5.0), child("b", ROOT, 1.0)])
    a.expand(["a"], [child("a1", "a", 6.0, step=1)])
    assert a.nodes["a1"].ancestors == ["a", ROOT]
    picked = [s.node.id for s in a.select(3, c=0.0)]  # c = 0: pure exploitation, ranked by Q
    # a (Q 6, older) and a1 (6) share a lineage; the root (Q 5: starting afresh) is a lineage of its own; then b
    assert picked == ["a", "root", "b"]
    assert [s.node.id for s in a.select(5, c=0.0)] == ["a", "root", "b", "a", "root"]  # too few: the best again
    assert a.nodes["a"].visits == 1 and a.nodes[ROOT].visits == 2 and a.total == 2


def test_visits_lower_a_states_bonus() -> None:
    a = Archive("start", None)
    a.expand([ROOT], [child("a", ROOT, 1.0), child("b", ROOT, 1.0 + 1e-9)])
    first = a.select(1, c=10.0)[0].node.id
    a.expand([first] * 5, [])
    assert a.select(1, c=10.0)[0].node.id != first


def test_equal_states_are_kept_once_and_the_archive_is_pruned_to_its_size() -> None:
    a = Archive("start", None, size=3)
    added = a.expand([ROOT], [child("a", ROOT, 1.0, state="same"), child("b", ROOT, 2.0, state="same"),
                              child("c", ROOT, 0.5), child("d", ROOT, 4.0)])
    assert added == 3
    assert set(a.nodes) == {ROOT, "d", "a"}  # the root stays; the best two of the rest
    assert a.best().id == "d"


def test_the_archive_round_trips_through_json() -> None:
    a = Archive("start", 0.5)
    a.expand([ROOT], [child("a", ROOT, 1.0)])
    a.curve.append({"step": 0, "mean": 1.0})
    b = Archive.from_json(json.loads(json.dumps(a.as_json())))
    assert b.as_json() == a.as_json()
    assert [s.node.id for s in b.select(2, 1.0)] == [s.node.id for s in a.select(2, 1.0)]


def sample_record(receipt: str, step: int, group: int, rollout: int, score: float) -> tuple[dict[str, Any],
                                                                                            list[dict[str, Any]]]:
    record = {"id": receipt, "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
              "completion_logprobs": [-0.5, -1.0], "release": "r1"}
    return record, [{"report_id": f"p{receipt}", "score": score,
                     "metadata": {"step": step, "group": group, "rollout": rollout}}]


def test_a_full_grid_becomes_one_adam_step_and_equal_groups_are_skipped() -> None:
    recipe = build("ttt-discover", {"groups": 2, "rollouts": 4, "lr": 1e-4})
    assert isinstance(recipe, TTTDiscover)
    grid = {(0, r): [0.0, 0.0, 0.0, 1.0][r] for r in range(4)} | {(1, r): 2.0 for r in range(4)}
    samples = [recipe.sample(*sample_record(f"R{g}{r}", 0, g, r, s)) for (g, r), s in grid.items()]
    assert all(s is not None for s in samples)
    assert not recipe.ready([s for s in samples[:-1] if s is not None])
    ready = [s for s in samples if s is not None]
    assert recipe.ready(ready)
    job = recipe.candidate(ready)
    assert [s.receipt for s in job.samples] == ["R00", "R01", "R02", "R03"]
    assert job.skipped == ["R10", "R11", "R12", "R13"]
    adv = [s.extra["advantage"] for s in job.samples if s.extra]
    assert adv == pytest.approx([-0.798, -0.798, -0.798, 11.849], abs=1e-3)  # the reference values
    assert job.optim["micro_batch"] == 4 and job.optim["epochs"] == 1  # one step per grid
    assert (job.optim["beta1"], job.optim["beta2"]) == (0.9, 0.95) and job.settings == {"kl_coef": 0.1}
    assert job.optim["max_grad_norm"] >= 1e30  # no clipping


def test_a_grid_whose_groups_all_score_alike_has_nothing_to_train() -> None:
    recipe = build("ttt-discover", {"groups": 1, "rollouts": 3})
    samples = [recipe.sample(*sample_record(f"R{r}", 0, 0, r, 1.0)) for r in range(3)]
    with pytest.raises(RecipeError, match="nothing to learn"):
        recipe.candidate([s for s in samples if s is not None])


@pytest.mark.parametrize("meta", [{"step": 0, "group": 0}, {"step": -1, "group": 0, "rollout": 0},
                                  {"step": True, "group": 0, "rollout": 0}])
def test_reports_without_a_coordinate_are_not_attempts(meta: dict[str, Any]) -> None:
    recipe = TTTDiscover(TTTConfig(groups=1, rollouts=3))
    record, reports = sample_record("R", 0, 0, 0, 1.0)
    reports[0]["metadata"] = meta
    assert recipe.sample(record, reports) is None


def test_the_prompt_template_is_checked_and_filled() -> None:
    with pytest.raises(RecipeError, match=r"recipe\.params\.prompt"):
        TTTDiscover(TTTConfig(prompt="{nope}"))
    recipe = TTTDiscover(TTTConfig(prompt="best {score}: {state}", system="be brief"))
    assert recipe.messages("x = 1", 2.5) == [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "best 2.5: x = 1"}]
    assert recipe.messages("", None)[-1]["content"] == "best none yet: "


def test_a_group_whose_weights_cannot_be_taken_is_dropped_not_fatal() -> None:
    recipe = TTTDiscover(TTTConfig(groups=1, rollouts=3))
    assert "dropped" in recipe.summarize([1e308, -1e308, 0.0])  # the leave-one-out weights underflow
    assert recipe.summarize([2.0, 2.0, 2.0]) == {"dropped": "every reward is equal", "mean": 2.0}
    assert recipe.summarize([0.0, 0.0, 1.0])["beta"] > 0
