"""The commit policy (reefd/commit/policy.py `commit`): one function for every writer. Unit tests on a real chain, then
its two kinds of callers, the publish route and a Grow job, driven in one in-process daemon on the tiny model
while a rival writer keeps moving the head: both follow the head the same number of times."""

from __future__ import annotations

import asyncio
import dataclasses
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reefd import config
from reefd.commit.chain import (
    Candidate,
    HeadConflict,
    NoRelease,
    NothingToRollBack,
    Pinned,
    Release,
    ReleaseChain,
    plan,
)
from reefd.commit.policy import REBASE_ATTEMPTS, commit
from tests.conftest import TOKEN, make_scenarios
from tests.test_gate_reuse import adapter


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[ReleaseChain]:
    yield ReleaseChain(tmp_path / "releases.git")


def base(chain: ReleaseChain) -> Release:
    return commit(chain, "s", Candidate("base", {"source": "import"}, exact=True), pin=None, on_conflict="discard")


class Rival:
    """Another writer that gets in first: before each of the next `times` artifact publishes, it appends a copy of
    the head, so the publisher's expected head is stale."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, times: int) -> None:
        self.left, self.moves = times, 0
        original = ReleaseChain.publish

        def racing(chain: ReleaseChain, scenario: str, **kw: Any) -> Release:
            if self.left and kw["kind"] == "adapter":
                self.left -= 1
                self.moves += 1
                head = chain.head(scenario)
                assert head is not None
                chain.promote(scenario, head.id, expected_head=head.id, meta={"summary": "a rival writer"})
            return original(chain, scenario, **kw)

        monkeypatch.setattr(ReleaseChain, "publish", racing)


def test_plan_checks_pin_head_and_target_without_writing(chain: ReleaseChain, tmp_path: Path) -> None:
    with pytest.raises(NoRelease):
        plan(chain, "s", Candidate("adapter", {}), pin=None)
    r0 = base(chain)
    r1 = commit(chain, "s", Candidate("adapter", {}, artifact=adapter(tmp_path, "a")), pin=None, on_conflict="discard")
    assert plan(chain, "s", Candidate("rollback", {}), pin=None).target == r0  # a plain rollback: the parent
    for refused in (Candidate("promote", {}, target=r0.id), Candidate("rollback", {}, target=r0.id),
                    Candidate("adapter", {}), Candidate("rollback", {}, target=r1.id, applies_pin=True)):
        with pytest.raises(Pinned):  # a pinned scenario takes only the reconciler's copy of its pin
            plan(chain, "s", refused, pin=r0.id)
    assert plan(chain, "s", Candidate("rollback", {}, target=r0.id, applies_pin=True), pin=r0.id).target == r0
    with pytest.raises(HeadConflict):  # an expected head named by the caller is checked
        plan(chain, "s", Candidate("adapter", {}, built_on=r0.id, exact=True), pin=None)
    with pytest.raises(HeadConflict):  # a scenario has one first release
        plan(chain, "s", Candidate("base", {}, exact=True), pin=None)
    commit(chain, "t", Candidate("base", {}, exact=True), pin=None, on_conflict="discard")
    with pytest.raises(NothingToRollBack):  # a scenario at its first release has no parent to roll back to
        plan(chain, "t", Candidate("rollback", {}), pin=None)
    assert chain.head("s") == r1 and len(chain.history("s")) == 2  # nothing was written


def test_a_failed_verdict_is_kept_as_rejected_with_the_verdict(chain: ReleaseChain, tmp_path: Path) -> None:
    r0 = base(chain)
    rel = commit(chain, "s", Candidate("adapter", {"source": "sao"}, artifact=adapter(tmp_path, "a"), built_on=r0.id,
                                       verdict={"verdict": "fail", "reason": "worse"}),
                 pin=None, on_conflict="rebase", keep_refused=True)
    assert rel.status == "rejected" and rel.meta["gate"]["reason"] == "worse" and rel.meta["built_on"] == r0.id
    assert chain.head("s") == r0


def test_a_pinned_scenario_refuses_or_keeps_a_candidate(chain: ReleaseChain, tmp_path: Path) -> None:
    r0 = base(chain)
    cand = Candidate("adapter", {}, artifact=adapter(tmp_path, "a"), built_on=r0.id, verdict={"verdict": "pass"})
    with pytest.raises(Pinned):
        commit(chain, "s", cand, pin=r0.id, on_conflict="rebase")
    kept = commit(chain, "s", cand, pin=r0.id, on_conflict="rebase", keep_refused=True)
    assert kept.status == "rejected" and kept.meta["refused"] == f"the scenario is pinned to {r0.id}"
    assert kept.meta["gate"] == {"verdict": "pass"} and chain.head("s") == r0
    unbuilt = commit(chain, "s", dataclasses.replace(cand, built_on=None, meta={"job": "j-2"}), pin=r0.id,
                     on_conflict="rebase", keep_refused=True)
    assert unbuilt.status == "rejected" and unbuilt.parent == r0.id == unbuilt.meta["built_on"]  # on the head


@pytest.mark.parametrize("moves", [REBASE_ATTEMPTS - 1, REBASE_ATTEMPTS])
def test_rebase_follows_a_moving_head_a_bounded_number_of_times(chain: ReleaseChain, tmp_path: Path, moves: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    r0 = base(chain)
    rival = Rival(monkeypatch, moves)
    cand = Candidate("adapter", {}, artifact=adapter(tmp_path, "a"), built_on=r0.id)
    if moves < REBASE_ATTEMPTS:
        rel = commit(chain, "s", cand, pin=None, on_conflict="rebase")
        assert rel.status == "released" and rel.seq == moves + 1 and rel.meta["rebased_from"] == r0.id
        assert rel.meta["built_on"] == rel.parent
    else:
        with pytest.raises(HeadConflict):
            commit(chain, "s", cand, pin=None, on_conflict="rebase")
        kept = commit(chain, "s", cand, pin=None, on_conflict="discard", keep_refused=True)
        assert kept.status == "rejected" and kept.meta["refused"].startswith("the head moved to ")
    assert rival.moves == moves


def test_discard_and_exact_never_rebase(chain: ReleaseChain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r0 = base(chain)
    Rival(monkeypatch, 2)
    with pytest.raises(HeadConflict):
        commit(chain, "s", Candidate("adapter", {}, artifact=adapter(tmp_path, "a"), built_on=r0.id), pin=None,
               on_conflict="discard")
    head = chain.head("s")
    assert head is not None
    with pytest.raises(HeadConflict):  # an operator's --expected-head is a compare-and-swap on exactly that head
        commit(chain, "s", Candidate("adapter", {}, artifact=adapter(tmp_path, "b"), built_on=head.id, exact=True),
               pin=None, on_conflict="rebase")


# ---------------------------------------------------------------- both callers, one daemon

SCENARIO = """defaults:
  - model: tiny
  - recipe: sao
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    batch_size: 4
release:
  on_conflict: rebase
serve:
  default_max_tokens: 4
"""


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21 in make_lora
def test_the_publish_route_and_a_grow_job_follow_a_moving_head_alike(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With on_conflict: rebase, a rival that moves the head REBASE_ATTEMPTS - 1 times is followed by both callers,
    one more move refuses both: the route answers 409 and writes nothing, the job's candidate is kept as
    rejected with the reason."""
    from aiohttp.test_utils import TestClient, TestServer

    from reefd.app import Settings, build_app
    from tests.loras import make_lora

    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": SCENARIO})
    settings = Settings(state_dir=tmp_path / "state", tokens=[TOKEN], scenarios=config.load_all(scen),
                        scenarios_dir=scen)
    auth = {"Authorization": f"Bearer {TOKEN}", "x-reef-scenario": "learn"}
    outcomes: dict[str, Any] = {}

    async def until_ready(client: TestClient[Any, Any]) -> None:
        deadline = time.monotonic() + 120
        while (await client.get("/readyz", headers=auth)).status != 200:
            assert time.monotonic() < deadline, "the daemon never became ready"
            await asyncio.sleep(0.2)

    async def publish(client: TestClient[Any, Any], folder: Path) -> tuple[int, dict[str, Any]]:
        archive = tmp_path / f"{folder.name}.tar"
        with tarfile.open(archive, "w") as tar:
            for f in folder.iterdir():
                tar.add(f, arcname=f.name)
        r = await client.post("/reef/scenarios/learn/releases", data=archive.read_bytes(),
                              headers={**auth, "content-type": "application/x-tar"})
        return r.status, await r.json()

    async def job(client: TestClient[Any, Any]) -> dict[str, Any]:
        for i in range(4):
            r = await client.post("/v1/chat/completions", headers=auth, json={
                "model": "learn", "messages": [{"role": "user", "content": f"q{i}"}]})
            receipt = r.headers["x-reef-agent-record-id"]
            await r.read()
            r = await client.post("/reef/report", headers=auth, json={"score": float(i % 2), "references": [receipt]})
            assert r.status == 200, await r.text()
        queued = await (await client.post("/reef/scenarios/learn/train", headers=auth, json={})).json()
        deadline = time.monotonic() + 180
        while True:
            found = await (await client.get(f"/reef/jobs/{queued['id']}", headers=auth)).json()
            if found["state"] not in ("queued", "running"):
                return dict(found)
            assert time.monotonic() < deadline, found
            await asyncio.sleep(0.2)

    async def main() -> None:
        async with TestClient(TestServer(build_app(settings))) as client:
            await until_ready(client)
            model = settings.state_dir / "models" / "tiny"
            for moves in (REBASE_ATTEMPTS - 1, REBASE_ATTEMPTS):
                rival = Rival(monkeypatch, moves)
                lora = make_lora(model, tmp_path / f"lora-{moves}", seed=moves)
                outcomes[f"route-{moves}"] = (*await publish(client, lora), rival.moves)
                rival = Rival(monkeypatch, moves)
                found = await job(client)
                rel = await (await client.get(f"/reef/releases/{found['release']}", headers=auth)).json()
                outcomes[f"job-{moves}"] = (found, rel["meta"], rival.moves)

    asyncio.run(main())
    ok, refused = REBASE_ATTEMPTS - 1, REBASE_ATTEMPTS
    status, body, moved = outcomes[f"route-{ok}"]
    assert (status, moved) == (201, ok) and body["release"]["meta"]["rebased_from"] != body["release"]["parent"]
    assert body["serving"] == body["release"]["id"]
    status, body, moved = outcomes[f"route-{refused}"]
    assert (status, moved, body["error"]["code"]) == (409, refused, "head_conflict")
    found, meta, moved = outcomes[f"job-{ok}"]
    assert (found["state"], moved, meta["rebased_from"]) == ("published", ok, found["built_on"]), found
    found, meta, moved = outcomes[f"job-{refused}"]
    assert (found["state"], moved) == ("rejected", refused), found
    assert meta["refused"].startswith("the head moved to ") and meta["built_on"] == found["built_on"]


def test_a_reconcile_that_keeps_failing_is_tried_again_less_often(tmp_path: Path) -> None:
    """30 s after the first failure, then twice as long after each failure in a row, at most 10 min; counted per
    scenario (reefd/commit/reconcile.py; a reconcile that succeeds starts its count again)."""
    from reefd.commit.reconcile import Reconciler
    from reefd.serve.scenarios import Registry

    async def delays() -> list[float]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            r = Reconciler(Registry({}, tmp_path / "state", session), ReleaseChain(tmp_path / "chain"),
                           tmp_path / "state", tmp_path)
            return [*(r.retry_after("a") for _ in range(7)), r.retry_after("b")]

    assert asyncio.run(delays()) == [30, 60, 120, 240, 480, 600, 600, 30]


def test_full_weights_refused_for_a_trial_are_kept_as_a_jobs_rejected_candidate(chain: ReleaseChain,
                                                                              tmp_path: Path) -> None:
    """A job's candidate the trial refuses (full weights on one replica) is kept as rejected, saying why; a route
    (no keep_refused) gets the refusal and nothing is written."""
    from reefd.commit.chain import TrialRefused

    head = base(chain)

    def trial(on: Release | None, cand: Candidate) -> dict[str, Any]:
        raise TrialRefused("s", "canary", 1)

    cand = Candidate("adapter", {"source": "sao"}, artifact=adapter(tmp_path, "a"), built_on=head.id)
    with pytest.raises(TrialRefused):
        commit(chain, "s", cand, pin=None, on_conflict="discard", trial=trial)
    kept = commit(chain, "s", cand, pin=None, on_conflict="discard", keep_refused=True, trial=trial)
    assert kept.status == "rejected" and "set model.replicas: 2 or more" in kept.meta["refused"]
    assert chain.head("s") == head and len(chain.history("s", include_rejected=True)) == 2
