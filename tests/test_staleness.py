"""Staleness (reefd/grow/staleness.py) on a real release chain and a real record store: releases behind the head counted
by seq (a promote of the same artifacts is a release too), samples past max_staleness dropped or kept to be
weighted, the recipes' params, the job's summary and its STALENESS cell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recipes.sao.recipe import SAO, SAOConfig
from reefd.cli.job_verbs import staleness_cell
from reefd.commit.chain import ReleaseChain
from reefd.grow.job_store import JobStore
from reefd.grow.recipes import RecipeError, Sample, build
from reefd.grow.runner import eligible
from reefd.grow.staleness import Policy, StalenessParams, age, behind, past
from reefd.observe.records import RecordStore
from tests.test_records import record, with_store


def sample(receipt: str, release: str | None) -> Sample:
    return Sample(receipt=receipt, prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], reward=1.0, group="g",
                  release=release)


def chain_of(tmp_path: Path) -> tuple[ReleaseChain, list[str]]:
    """base r0, an adapter r1, and r2: a promote of r0 (r0's artifacts again)."""
    chain = ReleaseChain(tmp_path / "releases.git")
    r0 = chain.publish("s1", expected_head=None, kind="base", artifact_dir=None, meta={"source": "base"})
    r1 = chain.publish("s1", expected_head=r0.id, kind="adapter", artifact_dir=None, meta={"source": "sao"})
    r2 = chain.promote("s1", r0.id, expected_head=r1.id)
    assert chain.artifacts(r2.id) == chain.artifacts(r0.id)
    return chain, [r0.id, r1.id, r2.id]


def test_releases_behind_the_head_are_counted_by_seq(tmp_path: Path) -> None:
    chain, (r0, r1, r2) = chain_of(tmp_path)
    head = chain.get(r2)
    assert behind(chain.history("s1"), head) == {r2: 0, r1: 1, r0: 2}
    assert behind(chain.history("s1"), chain.get(r1)) == {r2: 0, r1: 0, r0: 1}  # a head that moved on: 0
    assert not past(5, None) and not past(2, 2) and past(3, 2) and past(None, 100)


def test_drop_keeps_the_fresh_samples_and_lists_the_others(tmp_path: Path) -> None:
    chain, (r0, r1, r2) = chain_of(tmp_path)
    samples = [sample("a", r0), sample("b", r1), sample("c", r2), sample("d", "r9-0000000"), sample("e", None)]
    kept, aged = age(samples, behind(chain.history("s1"), chain.get(r2)), Policy(max_staleness=1))
    assert [s.receipt for s in kept] == ["b", "c"]
    assert aged.dropped == ["a", "d", "e"]  # older than 1 release, and two that are not in the chain
    assert aged.ages == {"a": 2, "b": 1, "c": 0, "d": None, "e": None}
    batch = aged.mark(kept)
    assert [(s.release, s.staleness, s.stale) for s in batch] == [(r1, 1, False), (r2, 0, False)]
    assert aged.summary(batch) == {"min": 0, "max": 1, "mean": 0.5, "off_chain": 0, "dropped": 3, "weighted": 0,
                                   "limit": 1}


def test_weight_keeps_every_sample_and_marks_the_stale_ones(tmp_path: Path) -> None:
    chain, (r0, r1, r2) = chain_of(tmp_path)
    samples = [sample("a", r0), sample("b", r1), sample("c", r2), sample("d", "r9-0000000")]
    kept, aged = age(samples, behind(chain.history("s1"), chain.get(r2)), Policy(1, "weight"))
    assert kept == samples and aged.dropped == []
    batch = aged.mark(kept)
    assert [s.stale for s in batch] == [True, False, False, True]
    assert aged.summary(batch) == {"min": 0, "max": 2, "mean": 1.0, "off_chain": 1, "dropped": 0, "weighted": 2,
                                   "limit": 1}
    # no limit: staleness is still measured, and nothing is stale
    kept, aged = age(samples, behind(chain.history("s1"), chain.get(r2)), Policy())
    assert kept == samples and not any(s.stale for s in aged.mark(kept))


def test_a_sample_the_recipe_rebuilds_is_marked_by_its_receipt(tmp_path: Path) -> None:
    chain, (r0, _, r2) = chain_of(tmp_path)
    _, aged = age([sample("a", r0)], behind(chain.history("s1"), chain.get(r2)), Policy(1, "weight"))
    rebuilt = Sample("a", [1], [2], [-0.5], 1.0, "g")  # as a recipe may make it again: no release
    assert [(s.release, s.staleness, s.stale) for s in aged.mark([rebuilt])] == [(r0, 2, True)]


def test_eligible_samples_carry_the_release_of_their_record(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        served = record("s1", release="r3-abcdef0", prompt_token_ids=[5, 6])
        await store.put_record(served)
        await store.put_report("s1", {"references": [served["id"]], "score": 1.0})
        found = eligible(store, SAO(SAOConfig()), "s1")
        assert [(s.receipt, s.release) for s in found] == [(served["id"], "r3-abcdef0")]

    with_store(tmp_path / "db", body)


def test_recipe_params() -> None:
    recipe = build("sao", {"max_staleness": 2, "stale": "weight", "stale_clip": 3.0})
    assert recipe.staleness == Policy(2, "weight")  # type: ignore[attr-defined]
    assert build("openclaw-rl", {"max_staleness": 0}).staleness == Policy(0, "drop")  # type: ignore[attr-defined]
    assert build("grpo", {}).staleness == Policy()  # type: ignore[attr-defined]
    for params, where in (({"stale": "sometimes"}, "recipe.params.stale"),
                          ({"max_staleness": -1}, "recipe.params.max_staleness"),
                          ({"stale_clip": 0.5}, "recipe.params.stale_clip")):
        with pytest.raises(RecipeError, match=re.escape(where)):
            build("sao", params)
    with pytest.raises(RecipeError, match="max_staleness"):  # a grid's attempts come from one release
        build("ttt-discover", {"max_staleness": 1})
    with pytest.raises(RecipeError, match=re.escape("recipe.params.stale: weight needs an objective that importance")):
        StalenessParams(max_staleness=1, stale="weight").policy(weighs=False)
    assert StalenessParams(max_staleness=1).policy(weighs=False) == Policy(1, "drop")


def test_the_sao_spec_settings_carry_the_clip() -> None:
    job = build("sao", {"stale_clip": 1.5, "batch_size": 1}).candidate([sample("a", None)])
    assert job.settings["stale_clip"] == 1.5  # type: ignore[union-attr]


def test_staleness_cell() -> None:
    assert staleness_cell(None) == "-"
    base = {"min": 0, "max": 2, "mean": 0.4, "off_chain": 0, "dropped": 0, "weighted": 0, "limit": None}
    assert staleness_cell(base) == "0-2"
    assert staleness_cell({**base, "max": 0}) == "0"
    assert staleness_cell({**base, "dropped": 3, "limit": 2}) == "0-2 (3 dropped)"
    assert staleness_cell({**base, "off_chain": 1, "weighted": 2}) == "0-inf (2 weighted)"
    assert staleness_cell({**base, "min": None, "max": None, "off_chain": 1}) == "inf"
    assert staleness_cell({**base, "min": None, "max": None, "dropped": 4}) == "- (4 dropped)"


def test_a_job_file_without_staleness_still_loads(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    job = store.new("s1", "manual", "sao")
    store.save(job)
    path = tmp_path / "jobs" / f"{job.id}.json"
    path.write_text(path.read_text().replace('"staleness": null,', ""))
    assert "staleness" not in path.read_text()
    assert JobStore(tmp_path / "jobs").jobs[job.id].staleness is None
