"""Retention against a real LMDB env and a real release chain: what is deleted (old, beyond max_records), what is
kept (a published release's lineage, a running job's batch), every index and count cleaned, space reused."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reefd.commit.chain import ReleaseChain
from reefd.config import RetentionConfig, ScenarioConfig
from reefd.grow.job_store import JobStore
from reefd.observe.receipts import new_receipt, receipt_floor, receipt_ms
from reefd.observe.records import RecordStore, UnknownReceipt
from reefd.observe.retention import Retention, lineage
from tests.test_records import noise, record, with_store

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
DAY_MS = 86_400_000


def receipt_at(ms: int) -> str:
    """A receipt made at `ms` (ms since the epoch), as new_receipt() would have made it then."""
    value = ms << 80 | secrets.randbits(80)
    return "".join(CROCKFORD[(value >> (5 * i)) & 31] for i in reversed(range(26)))


def aged(days: float, n: int, scenario: str = "s1", **fields: Any) -> list[dict[str, Any]]:
    """n records made `days` ago, oldest first."""
    start = int(time.time() * 1000 - days * DAY_MS)
    return [{**record(scenario, **fields), "id": receipt_at(start + i)} for i in range(n)]


def registry(**policies: RetentionConfig) -> Any:
    return SimpleNamespace(scenarios={name: SimpleNamespace(cfg=ScenarioConfig(name=name, retention=policy))
                                      for name, policy in policies.items()})


def chain_with(tmp_path: Path, scenario: str, *, published: list[str], rejected: list[str]) -> ReleaseChain:
    """A chain whose published release learned from `published`, and a refused candidate from `rejected`."""
    chain = ReleaseChain(tmp_path / "releases.git")
    base = chain.publish(scenario, expected_head=None, kind="base", artifact_dir=None, meta={"source": "base"})
    head = chain.publish(scenario, expected_head=base.id, kind="adapter", artifact_dir=None,
                         meta={"source": "sao", "receipts": published})
    chain.reject(scenario, built_on=head.id, kind="adapter", artifact_dir=None,
                 meta={"source": "sao", "receipts": rejected})
    return chain


async def put_all(store: RecordStore, records: list[dict[str, Any]]) -> list[str]:
    await asyncio.gather(*(store.put_record(r) for r in records))
    return [r["id"] for r in records]


def test_receipt_times_and_floors() -> None:
    before = time.time_ns() // 1_000_000
    receipt = new_receipt()
    assert before <= receipt_ms(receipt) <= time.time_ns() // 1_000_000
    ms = receipt_ms(receipt)
    assert receipt_floor(ms) <= receipt < receipt_floor(ms + 1)
    assert receipt_ms(receipt_floor(ms)) == ms and receipt_ms(receipt_at(ms)) == ms


def test_old_records_go_but_lineage_and_a_running_batch_stay(tmp_path: Path) -> None:
    """max_age_days: the old records go with their index entries and the reports only they had; a published
    release's receipts and a running job's batch stay, a refused candidate's do not; other scenarios untouched."""
    old, young, other = aged(40, 6, session="sess"), aged(0, 3), aged(40, 2, scenario="s2")
    o = [r["id"] for r in old]
    chain = chain_with(tmp_path, "s1", published=[o[0], o[1]], rejected=[o[2]])
    jobs = JobStore(tmp_path / "jobs")
    job = jobs.new("s1", "manual", "sao")
    job.state, job.stage, job.receipts = "running", "train", [o[3]]

    async def body(store: RecordStore) -> None:
        await put_all(store, old + young + other)
        y = [r["id"] for r in young]
        await store.put_report("s1", {"references": [o[2], y[0]], "score": 1.0})  # keeps a record: stays
        await store.put_report("s1", {"references": [o[4]], "score": 0.0})  # only deleted ones: goes
        await store.put_report("s1", {"references": [o[0]], "score": 0.5})  # on lineage: stays
        await store.mark_consumed("s1", [o[5]], "j-old")
        retention = Retention(registry(s1=RetentionConfig(max_age_days=30)), store, chain, jobs)

        assert await retention.sweep("s1") == 3
        assert [r["id"] for r in store.list_records("s1", limit=100)] == [o[0], o[1], o[3], *y]
        for gone in (o[2], o[4], o[5]):
            assert store.get_record(gone) is None
        assert store.counts()["s1"] == {"records": 6, "reports": 2, "practice_records": 0, "practice_reports": 0}
        assert store.counts()["s2"] == {"records": 2, "reports": 0, "practice_records": 0, "practice_reports": 0}
        assert [r["score"] for r in store.get_record(y[0])["reports"]] == [1.0]  # as reported: both references
        assert store.get_record(y[0])["reports"][0]["references"] == [o[2], y[0]]
        assert [r["id"] for r in store.list_records("s1", session="sess", limit=100)] == [o[0], o[1], o[3]]
        assert o[2] not in {r["id"] for r in store.unconsumed("s1")}
        with pytest.raises(UnknownReceipt):
            await store.put_report("s1", {"references": [o[4]], "score": 1.0})
        assert await retention.sweep("s1") == 0  # nothing more is old

        job.state = "published"  # the job ended without a release in the chain: its batch is not lineage
        assert await retention.sweep("s1") == 1
        assert store.get_record(o[3]) is None and store.get_record(o[0]) is not None
        assert retention.deleted == {"s1": 4}

    with_store(tmp_path / "db", body)


def test_max_records_keeps_the_newest_and_the_lineage_in_bounded_batches(tmp_path: Path) -> None:
    records = aged(0, 25)
    ids = [r["id"] for r in records]
    chain = chain_with(tmp_path, "s1", published=[ids[0], ids[5]], rejected=[])

    async def body(store: RecordStore) -> None:
        await put_all(store, records)
        retention = Retention(registry(s1=RetentionConfig(max_records=10)), store, chain,
                              JobStore(tmp_path / "jobs"))
        retention.BATCH = 4
        batches: list[int] = []
        delete = store.delete_records

        async def counted(scenario: str, receipts: list[str]) -> int:
            batches.append(len(receipts))
            return await delete(scenario, receipts)

        store.delete_records = counted  # type: ignore[method-assign]
        assert await retention.sweep("s1") == 13  # lineage does not count against the bound: 10 others stay
        assert batches == [4, 4, 4, 1]
        assert [r["id"] for r in store.list_records("s1", limit=100)] == [ids[0], ids[5], *ids[15:]]
        assert store.counts()["s1"]["records"] == 12
        assert await retention.sweep("s1") == 0

    with_store(tmp_path / "db", body)


def test_a_batch_being_chosen_holds_deletion_until_its_receipts_are_known(tmp_path: Path) -> None:
    """The runner chooses a job's batch under store.selecting(scenario): a sweep waits for it, then keeps the job's
    receipts."""
    records = aged(40, 4)
    ids = [r["id"] for r in records]
    jobs = JobStore(tmp_path / "jobs")
    chain = chain_with(tmp_path, "s1", published=[], rejected=[])

    async def body(store: RecordStore) -> None:
        await put_all(store, records)
        retention = Retention(registry(s1=RetentionConfig(max_age_days=1)), store, chain, jobs)
        async with store.selecting("s1"):
            job = jobs.new("s1", "manual", "sao")
            job.state, job.stage = "running", "batch"
            sweep = asyncio.create_task(retention.sweep("s1"))
            for _ in range(50):
                await asyncio.sleep(0)
            assert not sweep.done() and store.counts()["s1"]["records"] == 4
            job.receipts = ids[:2]
        assert await sweep == 2
        assert [r["id"] for r in store.list_records("s1")] == ids[:2]

    with_store(tmp_path / "db", body)


def test_lineage_follows_rollbacks_and_promotes(tmp_path: Path) -> None:
    a, b = new_receipt(), new_receipt()
    chain = chain_with(tmp_path, "s1", published=[a], rejected=[b])
    assert lineage(chain, "s1") == {a}
    refused = chain.rejected("s1")[0]
    chain.promote("s1", refused.id, expected_head=chain.head("s1").id)  # type: ignore[union-attr]
    assert lineage(chain, "s1") == {a, b}


def test_freed_pages_are_reused(tmp_path: Path) -> None:
    """Insert N records, delete them all by retention, insert N again: LMDB reuses the freed pages, so the data file
    stays the size it had. Without the deletion the same N records grow it by about as much again."""
    n = 2000
    data = tmp_path / "db" / "data.mdb"

    async def body(store: RecordStore) -> list[int]:
        retention = Retention(registry(s1=RetentionConfig(max_age_days=30)), store,
                              chain_with(tmp_path, "s1", published=[], rejected=[]), JobStore(tmp_path / "jobs"))
        sizes = []
        for days in (40, 0, 0):
            await put_all(store, aged(days, n, text=noise(1500)))
            if days:
                assert await retention.sweep("s1") == n
            sizes.append(os.path.getsize(data))
        return sizes

    first, refilled, grown = with_store(tmp_path / "db", body)
    assert first > n * 1500  # the records are really there
    assert refilled <= first * 1.05  # the second N took the first N's pages
    assert grown >= first * 1.5  # without a deletion, N more records need about N's worth of new pages


def test_a_batch_with_a_record_that_cannot_be_read_deletes_nothing(tmp_path: Path) -> None:
    """Deleting reads every record and report first: one that cannot be read fails the batch before any write, so
    no index is left pointing at nothing and the counts stay true."""
    records = aged(0, 3)
    ids = [r["id"] for r in records]

    async def body(store: RecordStore) -> None:
        await put_all(store, records)
        env = store._env
        assert env is not None
        with env.begin(write=True) as txn:
            txn.put(ids[1].encode(), b"\x00not a record", db=store._dbs["records"])
        with pytest.raises(ValueError):
            await store.delete_records("s1", ids)
        with env.begin() as txn:
            assert all(txn.get(f"s1\0{r}".encode(), db=store._dbs["by_scenario"]) is not None for r in ids)
        assert store.counts()["s1"]["records"] == 3
        assert store.get_record(ids[0]) is not None and store.get_record(ids[2]) is not None

    with_store(tmp_path / "db", body)
