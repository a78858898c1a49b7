"""The recipe contract: the registry (names and dotted paths), params validated into a recipe's Config, and
which records are eligible."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from reefd.grow.recipes import RecipeError, RecordOnly, Sample, WeightJob, build, scored_rollout


def record(**extra: Any) -> dict[str, Any]:
    base = {"id": "01JABCDEFGHJKMNPQRSTVWXYZ0", "prompt_token_ids": [1, 2, 3], "completion_token_ids": [7, 8],
            "completion_logprobs": [-0.5, None]}
    return {**base, **extra}


def report(score: Any, rid: str = "rpt_1") -> dict[str, Any]:
    return {"report_id": rid, "score": score}


@dataclass
class EchoConfig:
    size: int = 2


class Echo:
    """A user recipe, found by dotted path."""

    Config = EchoConfig
    produces = "weights"

    def __init__(self, cfg: EchoConfig) -> None:
        self.cfg = cfg

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return scored_rollout(record, reports)

    def ready(self, samples: list[Sample]) -> bool:
        return len(samples) >= self.cfg.size

    def candidate(self, samples: list[Sample]) -> WeightJob:
        return WeightJob("recipes.sao.objective:SAOObjective", samples, {}, {})


def test_shipped_names_and_dotted_paths() -> None:
    assert isinstance(build("record", {}), RecordOnly) and build("record", {}).produces == "nothing"
    sao = build("sao", {"batch_size": 3})
    assert sao.produces == "weights" and not sao.ready([]) and sao.cfg.batch_size == 3  # type: ignore[attr-defined]
    assert build("grpo", {}).candidate([]).objective == "recipes.sao.objective:GRPOObjective"  # type: ignore[union-attr]
    echo = build("tests.test_recipes:Echo", {"size": 5})
    assert isinstance(echo, Echo) and echo.cfg.size == 5
    settings = build("sao", {"normalize_advantages": True, "gae_alpha": 100}).candidate([]).settings  # type: ignore[union-attr]
    assert settings["normalize_advantages"] is True  # the objective whitens each micro-batch's advantages
    assert settings["gae_alpha"] == 100  # lambda = 1 - 1 / (100 * length): near 1 for short answers
    assert build("sao", {}).candidate([]).settings["normalize_advantages"] is False  # type: ignore[union-attr]


@pytest.mark.parametrize("name,params,message", [
    ("sao", {"batch_size": 0}, "recipe.params.batch_size: 0 is less than the minimum of 1"),
    ("sao", {"batchsize": 4}, "recipe.params: Additional properties are not allowed ('batchsize' was unexpected)"),
    ("sao", {"lr": "fast"}, "recipe.params.lr: 'fast' is not of type 'number'"),
    ("nope", {}, "unknown recipe 'nope': use one of composite, gepa, grpo, openclaw-rl, record, sao, skillclaw, "
                 "ttt-discover or pkg.mod:Class"),
    ("no.such.module:X", {}, "recipe 'no.such.module:X' cannot be imported: No module named 'no'"),
    ("tests.test_recipes:EchoConfig", {}, "recipe 'tests.test_recipes:EchoConfig' has no 'Config'"),
])
def test_bad_recipes_and_params_are_one_clear_line(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError) as exc:
        build(name, params)
    assert str(exc.value).startswith(message)


def test_eligibility_needs_engine_tokens_and_a_score() -> None:
    sample = scored_rollout(record(), [report(0.25, "rpt_a"), report("n/a", "rpt_b"), report(1, "rpt_c")])
    assert sample is not None
    assert (sample.reward, sample.reports, sample.logprobs) == (1.0, ["rpt_a", "rpt_c"], [-0.5, None])
    assert sample.group == scored_rollout(record(id="01JABCDEFGHJKMNPQRSTVWXYZ1"), [report(0)]).group  # type: ignore[union-attr]
    assert sample.group != scored_rollout(record(prompt_token_ids=[1, 2]), [report(0)]).group  # type: ignore[union-attr]
    assert scored_rollout(record(), []) is None  # not scored
    assert scored_rollout(record(), [report(True)]) is None  # a boolean is not a score
    assert scored_rollout(record(completion_token_ids=None), [report(1)]) is None  # upstream: no token ids
    assert scored_rollout(record(completion_logprobs=[-1.0]), [report(1)]) is None  # ids and logprobs disagree


def test_groups_are_stable_across_processes() -> None:
    code = ("from reefd.grow.recipes import scored_rollout; print(scored_rollout({'id': 'x',"
            " 'prompt_token_ids': [1, 2, 3], 'completion_token_ids': [4], 'completion_logprobs': [0.0]},"
            " [{'report_id': 'r', 'score': 1}]).group)")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1


def test_daemon_side_of_recipes_does_not_import_torch() -> None:
    code = ("import reefd.grow.recipes, recipes.sao.recipe, sys; reefd.grow.recipes.build('sao', {}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
