"""The trial test (reefd/commit/trials.py): Student's t, the decision rule and its error over many looks, sticky sides,
and what a release's meta says of its trial."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from reefd.commit import decision as rule
from reefd.commit import trials as canary
from reefd.commit.chain import Candidate, Release, ReleaseChain, TrialRefused
from reefd.config import CanaryConfig, ReleaseConfig, ShadowConfig


@pytest.mark.parametrize(("p", "df", "expected"), [
    (0.95, 1, 6.3138), (0.95, 5, 2.0150), (0.975, 10, 2.2281), (0.995, 3, 5.8409), (0.95, 1e9, 1.6449),
    (0.99, 30, 2.4573)])
def test_t_quantiles_match_the_tables(p: float, df: float, expected: float) -> None:
    assert rule.t_quantile(p, df) == pytest.approx(expected, abs=2e-4)


def test_looks_fall_on_doublings_of_the_smaller_side() -> None:
    assert [rule.look_of(n, 50) for n in (49, 50, 99, 100, 199, 200, 400)] == [None, 0, 0, 1, 1, 2, 3]


def tally(values: list[float]) -> rule.Tally:
    t = rule.Tally()
    for v in values:
        t.add(v)
    return t


def test_a_clear_difference_decides_at_the_first_look() -> None:
    cfg = CanaryConfig(share=0.1, min_reports=20, max_drop=0.05)
    better, worse = tally([1.0] * 15 + [0.0] * 5), tally([0.0] * 15 + [1.0] * 5)
    assert rule.compare(better, worse, cfg)["decision"] == "promote"
    verdict = rule.compare(worse, better, cfg)
    assert verdict["decision"] == "rollback" and verdict["interval"][1] < -0.05
    assert verdict["test"]["look"] == 0 and verdict["test"]["alpha"] == pytest.approx(0.025)
    gathering = rule.compare(tally([1.0] * 19), worse, cfg)
    assert gathering["decision"] is None and gathering["reason"].startswith("gathering: 19 of 20")


def test_a_close_call_waits_for_more_scores() -> None:
    cfg = CanaryConfig(share=0.5, min_reports=20, max_drop=0.05)
    rng = random.Random(3)
    a = tally([float(rng.random() < 0.5) for _ in range(20)])
    b = tally([float(rng.random() < 0.5) for _ in range(20)])
    assert rule.compare(a, b, cfg)["decision"] is None  # ±0.3 of noise cannot tell a 0.05 drop


def test_identical_releases_are_rarely_rolled_back_over_all_looks() -> None:
    """The error budget holds over the sequence of looks: two identical sides, tested at every doubling up to 16
    times min_reports, are rolled back in well under 1 - confidence of the runs."""
    cfg = CanaryConfig(share=0.5, min_reports=20, max_drop=0.05, confidence=0.95)
    rng = random.Random(7)
    runs, rollbacks = 200, 0
    for _ in range(runs):
        a, b = rule.Tally(), rule.Tally()
        for look in range(5):
            while a.n < cfg.min_reports * 2 ** look:
                a.add(float(rng.random() < 0.6))
                b.add(float(rng.random() < 0.6))
            decision = rule.compare(a, b, cfg)["decision"]
            if decision is not None:
                rollbacks += decision == "rollback"
                break
    assert rollbacks / runs <= 0.05


def test_pairs_are_compared_by_their_differences() -> None:
    cfg = ShadowConfig(share=1.0, min_reports=10, max_drop=0.05, scorer="x:y")
    served, shadow, pairs = rule.Tally(), rule.Tally(), rule.Tally()
    for i in range(10):
        s = 0.5 + 0.04 * (i % 5)
        served.add(s)
        shadow.add(s + 0.2)
        pairs.add(0.2)
    verdict = rule.compare(shadow, served, cfg, pairs=pairs)
    assert verdict["decision"] == "promote" and verdict["test"]["kind"] == "paired t, one-sided"
    assert verdict["diff"] == pytest.approx(0.2)


def test_sides_are_sticky_and_near_the_share() -> None:
    on = [canary.takes("r5-aaaaaaa", 0.2, f"s{i}") for i in range(5000)]
    assert 0.17 < sum(on) / len(on) < 0.23
    assert on == [canary.takes("r5-aaaaaaa", 0.2, f"s{i}") for i in range(5000)]  # the same session, the same side
    assert on != [canary.takes("r6-bbbbbbb", 0.2, f"s{i}") for i in range(5000)]  # each trial draws its own
    assert canary.takes("r5-aaaaaaa", 0.0, "s1", sticky="r5-aaaaaaa", stable="r4-ccccccc")  # where it started
    assert not canary.takes("r5-aaaaaaa", 1.0, "s1", sticky="r4-ccccccc", stable="r4-ccccccc")
    assert not canary.takes("r5-aaaaaaa", 1.0, None)


def test_metrics_read_scores_or_metadata() -> None:
    report = {"score": 0.5, "metadata": {"latency": 3, "ok": True}}
    assert canary.metric_of(report, "score") == 0.5
    assert canary.metric_of(report, "metadata.latency") == 3.0
    assert canary.metric_of(report, "metadata.ok") is None and canary.metric_of({"score": None}, "score") is None
    huge = {"score": 1e308, "metadata": {"latency": -1e12}}  # outside a score's range: no score
    assert canary.metric_of(huge, "score") is None and canary.metric_of(huge, "metadata.latency") is None


def release(meta: dict[str, object], rid: str = "r1-aaaaaaa") -> Release:
    return Release(rid, "s", "r0-bbbbbbb", "adapter", meta, "c" * 40, "2026-12-02T00:00:00Z", 1)


def test_a_trial_is_active_while_declared_undecided_and_unpinned() -> None:
    on = ReleaseConfig(canary=CanaryConfig(share=0.1))
    meta = {"canary": {"mode": "canary", "stable": "r0-bbbbbbb", "started_at": 5.0}}
    spec = canary.active(on, release(meta))
    assert spec is not None and (spec.stable, spec.share, spec.deadline) == ("r0-bbbbbbb", 0.1, 5.0 + 86400)
    assert canary.active(ReleaseConfig(), release(meta)) is None  # no longer declared
    assert canary.active(ReleaseConfig(pin="r0-bbbbbbb", canary=CanaryConfig(share=0.1)), release(meta)) is None
    decided = {"canary": {**meta["canary"], "decision": "promote"}}
    assert canary.active(on, release(decided)) is None
    assert canary.active(ReleaseConfig(shadow=ShadowConfig(share=0.1, scorer="a:b")), release(meta)) is None


def test_the_meta_of_a_new_release_starts_supersedes_or_ends_a_trial(tmp_path: Path) -> None:
    chain = ReleaseChain(tmp_path / "chain")
    base = chain.publish("s", expected_head=None, kind="base", artifact_dir=None, meta={})
    trials = canary.Trials(None, chain, None, clock=lambda: 100.0)  # type: ignore[arg-type]
    cfg = ReleaseConfig(canary=CanaryConfig(share=0.25))
    folder = tmp_path / "h"
    (folder / "rules").mkdir(parents=True)
    (folder / "rules" / "a.md").write_text("a\n")
    started = trials.meta_for("s", cfg, base, Candidate("harness", {}, artifact=folder))["canary"]
    assert (started["mode"], started["stable"], started["share"], started["started_at"]) == \
        ("canary", base.id, 0.25, 100.0)
    first = chain.publish("s", expected_head=base.id, kind="harness", artifact_dir=folder, meta={"canary": started})
    again = trials.meta_for("s", cfg, first, Candidate("harness", {}, artifact=folder))["canary"]
    assert again["stable"] == base.id and again["supersedes"]["release"] == first.id
    ended = trials.meta_for("s", cfg, first, Candidate("rollback", {}))["canary"]
    assert (ended["decision"], ended["reason"]) == ("rollback", "decided by an operator")
    assert trials.meta_for("s", cfg, first, Candidate("promote", {}, target=first.id))["canary"]["decision"] == \
        "promote"
    assert trials.meta_for("s", cfg, first, Candidate("promote", {"source": "canary"}, target=first.id)) == {}
    assert trials.meta_for("s", ReleaseConfig(), base, Candidate("harness", {}, artifact=folder)) == {}
    # full weights go on trial where two or more replicas host one; elsewhere they are refused, saying why
    assert trials.meta_for("s", cfg, base, Candidate("weights", {}, artifact=folder), 2)["canary"]["stable"] == base.id
    with pytest.raises(TrialRefused, match=r"runs 1 \(one process serves one set of weights\): set model.replicas"):
        trials.meta_for("s", cfg, base, Candidate("weights", {}, artifact=folder), 1)
    assert trials.meta_for("s", ReleaseConfig(), base, Candidate("weights", {}, artifact=folder), 1) == {}


def test_reports_and_judgments_count_for_their_side_and_a_restart_counts_them_again(tmp_path: Path) -> None:
    """A real record store: each report counts once for the side that served its record (a judge's too), records
    of other releases and shadow records do not count, and a new Trials (a restarted reefd) rebuilds the same
    counts from the store; the first look then decides, and the decision is committed."""
    from reefd.observe.receipts import new_receipt
    from reefd.observe.records import RecordStore

    cfg = ReleaseConfig(canary=CanaryConfig(share=0.5, min_reports=3, max_drop=0.1))
    meta = {"canary": {"mode": "canary", "stable": "r1-stable0", "started_at": time.time() - 1}}
    head = Release("r2-canary0", "s", "r1-stable0", "adapter", meta, "c" * 40, "2026-12-02T00:00:00Z", 2)
    decided: list[Candidate] = []

    async def decide(scenario: str, cand: Candidate) -> Release:
        decided.append(cand)
        return head

    async def main() -> tuple[dict[str, object], dict[str, object]]:
        store = RecordStore(tmp_path / "records")
        await store.open()
        try:
            trials = canary.Trials(store, None, decide)  # type: ignore[arg-type]
            store.subscribe_reports(trials.reported)
            trials.serving("s", cfg, head)
            for release, score, source in [("r2-canary0", 1.0, "client"), ("r1-stable0", 0.0, "client"),
                                           ("r2-canary0", 1.0, "judge"), ("r0-older00", 0.0, "client")]:
                receipt = new_receipt()
                await store.put_record({"id": receipt, "scenario": "s", "release": release})
                await store.put_report("s", {"references": [receipt], "score": score}, source=source)
            shadow = new_receipt()
            await store.put_record({"id": shadow, "scenario": "s", "release": "r2-canary0", "turn_kind": "shadow",
                                    "shadow": {"of": "x", "score": 0.0, "served_score": 1.0}})
            await store.put_report("s", {"references": [shadow], "score": 0.0})
            for _ in range(100):
                await asyncio.sleep(0.01)
                if (trials.describe("s") or {}).get("canary", {}).get("n") == 2:  # type: ignore[union-attr]
                    break
            live = trials.describe("s")
            again = canary.Trials(store, None, decide)  # type: ignore[arg-type]
            again.serving("s", cfg, head)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if (again.describe("s") or {}).get("loaded"):
                    break
            rebuilt = again.describe("s")
            for score in (0.0, 0.0):
                receipt = new_receipt()
                await store.put_record({"id": receipt, "scenario": "s", "release": "r1-stable0"})
                await store.put_report("s", {"references": [receipt], "score": score})
            receipt = new_receipt()
            await store.put_record({"id": receipt, "scenario": "s", "release": "r2-canary0"})
            store.subscribe_reports(again.reported)
            await store.put_report("s", {"references": [receipt], "score": 1.0})
            for _ in range(100):
                await asyncio.sleep(0.01)
                if decided:
                    break
            await trials.close()
            await again.close()
            assert live is not None and rebuilt is not None
            return live, rebuilt
        finally:
            await store.close()

    live, rebuilt = asyncio.run(main())
    assert live["canary"] == {"n": 2, "mean": 1.0, "sd": 0.0} and live["stable"]["n"] == 1  # type: ignore[index]
    assert (rebuilt["canary"], rebuilt["stable"]) == (live["canary"], live["stable"])
    assert decided and decided[0].kind == "promote" and decided[0].target == "r2-canary0"
    assert decided[0].meta["canary"]["canary"]["n"] == 3 and decided[0].meta["source"] == "canary"


def test_a_report_spanning_both_sides_counts_once_for_its_earliest_record(tmp_path: Path) -> None:
    """One report that references a stable record and then a canary record (and one in the other order) is one
    observation each: for the side of the earliest record it references, live and in a restart's recount."""
    from reefd.observe.receipts import new_receipt
    from reefd.observe.records import RecordStore

    cfg = ReleaseConfig(canary=CanaryConfig(share=0.5, min_reports=50))
    meta = {"canary": {"mode": "canary", "stable": "r1-stable0", "started_at": time.time() - 1}}
    head = Release("r2-canary0", "s", "r1-stable0", "adapter", meta, "c" * 40, "2026-12-02T00:00:00Z", 2)

    async def counts(trials: canary.Trials) -> dict[str, object]:
        for _ in range(200):
            await asyncio.sleep(0.01)
            found = trials.describe("s") or {}
            if found.get("loaded") is not False and found.get("stable", {}).get("n") == 2:  # type: ignore[union-attr]
                break
        return dict(trials.describe("s") or {})

    async def main() -> tuple[dict[str, object], dict[str, object]]:
        store = RecordStore(tmp_path / "records")
        await store.open()
        try:
            trials = canary.Trials(store, None, None)  # type: ignore[arg-type]
            store.subscribe_reports(trials.reported)
            trials.serving("s", cfg, head)
            for first, second in (("r1-stable0", "r2-canary0"), ("r1-stable0", "r2-canary0")):
                older, newer = new_receipt(), new_receipt()
                await store.put_record({"id": older, "scenario": "s", "release": first})
                await store.put_record({"id": newer, "scenario": "s", "release": second})
                await store.put_report("s", {"references": [newer, older], "score": 1.0})  # listed newest first
            live = await counts(trials)
            again = canary.Trials(store, None, None)  # type: ignore[arg-type]
            again.serving("s", cfg, head)
            rebuilt = await counts(again)
            await trials.close()
            await again.close()
            return live, rebuilt
        finally:
            await store.close()

    live, rebuilt = asyncio.run(main())
    assert live["stable"]["n"] == 2 and live["canary"]["n"] == 0, live  # type: ignore[index]
    assert (rebuilt["canary"], rebuilt["stable"]) == (live["canary"], live["stable"])


def test_a_trial_past_its_max_age_is_resolved_by_on_timeout(tmp_path: Path) -> None:
    """Too few scores by max_age_s: on_timeout decides (here promote), and the evidence says why."""
    from reefd.observe.records import RecordStore

    cfg = ReleaseConfig(canary=CanaryConfig(share=0.5, min_reports=50, max_age_s=60, on_timeout="promote"))
    now = [1000.0]
    meta = {"canary": {"mode": "canary", "stable": "r1-stable0", "started_at": 990.0}}
    head = Release("r2-canary0", "s", "r1-stable0", "adapter", meta, "c" * 40, "2026-12-02T00:00:00Z", 2)
    decided: list[Candidate] = []

    async def decide(scenario: str, cand: Candidate) -> Release:
        decided.append(cand)
        return head

    async def main() -> tuple[object, object]:
        store = RecordStore(tmp_path / "records")
        await store.open()
        try:
            trials = canary.Trials(store, None, decide, clock=lambda: now[0])  # type: ignore[arg-type]
            trials.serving("s", cfg, head)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if (trials.describe("s") or {}).get("loaded"):
                    break
            undecided = list(decided)
            now[0] = 1051.0  # past started_at + max_age_s
            trials._tick("s", trials._watches["s"])
            for _ in range(100):
                await asyncio.sleep(0.01)
                if decided:
                    break
            await trials.close()
            return undecided, trials.describe("s")
        finally:
            await store.close()

    undecided, _ = asyncio.run(main())
    assert undecided == []
    assert len(decided) == 1 and decided[0].kind == "promote" and decided[0].target == "r2-canary0"
    reason = decided[0].meta["canary"]["reason"]
    assert reason.startswith("timed out after 60 s undecided") and reason.endswith("on_timeout: promote")
