"""RecordStore against a real LMDB env in tmp_path: receipts, records, reports, group commit, growth, crashes."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from reefd.observe.recordcodec import pack
from reefd.observe.records import (
    ClaimTaken,
    RecordStore,
    ReportConflict,
    StorageError,
    StoreClosed,
    UnknownReceipt,
    new_receipt,
)

ROOT = Path(__file__).resolve().parents[1]
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def with_store(path: Path, body: Callable[[RecordStore], Awaitable[Any]], **options: Any) -> Any:
    """Run `body(store)` on a fresh event loop with an open store, and close it afterwards."""

    async def main() -> Any:
        store = RecordStore(path, **options)
        await store.open()
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def record(scenario: str = "s1", **fields: Any) -> dict[str, Any]:
    return {"id": new_receipt(), "scenario": scenario, "request": {"messages": [{"role": "user", "content": "hi"}]},
            "completion_token_ids": [1, 2, 3], "completion_logprobs": [-0.5, -0.25, -0.125], **fields}


def counted(records: int, reports: int, practice_records: int = 0, practice_reports: int = 0) -> dict[str, int]:
    """A scenario's entry of `RecordStore.counts()`."""
    return {"records": records, "reports": reports, "practice_records": practice_records,
            "practice_reports": practice_reports}


def reports_of(store: RecordStore, receipt: str) -> list[dict[str, Any]]:
    found = store.get_record(receipt)
    assert found is not None
    return list(found["reports"])


def noise(nbytes: int) -> str:
    """Text that does not compress much, so the map really fills."""
    return base64.b64encode(os.urandom(nbytes)).decode()


# --- receipts ---------------------------------------------------------------------------------

def test_receipts_are_ulids_sorted_in_creation_order() -> None:
    before_ms = time.time_ns() // 1_000_000
    receipts = [new_receipt() for _ in range(20000)]
    after_ms = time.time_ns() // 1_000_000
    assert len(set(receipts)) == len(receipts)
    assert receipts == sorted(receipts)
    for receipt in receipts[:: 997]:
        assert len(receipt) == 26 and set(receipt) <= set(CROCKFORD)
        value = 0
        for char in receipt:
            value = value * 32 + CROCKFORD.index(char)
        assert value < 1 << 128
        assert before_ms <= value >> 80 <= after_ms + 1  # 48-bit ms timestamp on top, 80 random bits below


def test_receipts_are_monotonic_across_threads() -> None:
    out: list[list[str]] = [[] for _ in range(4)]

    def make(k: int) -> None:
        out[k].extend(new_receipt() for _ in range(5000))

    threads = [threading.Thread(target=make, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r for chunk in out for r in chunk}) == 20000
    assert all(chunk == sorted(chunk) for chunk in out)


# --- records ----------------------------------------------------------------------------------

def test_put_get_round_trip_and_reopen(tmp_path: Path) -> None:
    rec = record(text="é ☃ \U0001f600", nested={"a": [1, 2.5, None, True]})

    async def write(store: RecordStore) -> None:
        await store.put_record(rec)
        assert store.stats["commits"] == store.stats["ops"] == 1  # a lone write commits at once, alone
        assert store.get_record(rec["id"]) == {**rec, "reports": []}
        assert store.get_record(new_receipt()) is None
        assert store.get_record("not-a-receipt") is None
        with pytest.raises(ValueError, match="receipt"):
            await store.put_record({**rec, "id": "nope"})
        with pytest.raises(ValueError, match="scenario"):
            await store.put_record({**rec, "id": new_receipt(), "scenario": ""})
        with pytest.raises(ValueError, match="already stored"):
            await store.put_record(rec)

    with_store(tmp_path / "db", write)

    async def read(store: RecordStore) -> None:
        assert store.get_record(rec["id"]) == {**rec, "reports": []}
        assert store.counts() == {"s1": counted(1, 0)}

    with_store(tmp_path / "db", read)


def test_list_records_of_one_session(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        mine, theirs = [], []
        for i in range(6):
            rec = record("s1", session="x" * 600 if i % 2 else "conv", i=i)  # long ids are fine
            await store.put_record(rec)
            (theirs if i % 2 else mine).append(rec["id"])
        await store.put_record(record("s2", session="conv"))  # same session id, other scenario
        await store.put_record(record("s1"))  # no session at all
        assert [r["id"] for r in store.list_records("s1", session="conv")] == mine
        assert [r["id"] for r in store.list_records("s1", session="x" * 600)] == theirs
        assert [r["id"] for r in store.list_records("s1", session="conv", after=mine[0], limit=1)] == mine[1:2]
        assert store.list_records("s1", session="nobody") == []

    with_store(tmp_path / "db", body)


def test_list_records_pages_one_scenario_in_receipt_order(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        written: dict[str, list[str]] = {"a": [], "ab": [], "b": []}
        for i in range(25):
            for scenario in written:
                rec = record(scenario, i=i)
                await store.put_record(rec)
                written[scenario].append(rec["id"])
        pages, after = [], None
        while page := store.list_records("a", after=after, limit=10):
            pages.append([r["id"] for r in page])
            assert all(r["scenario"] == "a" and r["reports"] == [] for r in page)
            after = page[-1]["id"]
        assert [len(p) for p in pages] == [10, 10, 5]
        assert [rid for p in pages for rid in p] == written["a"]
        assert [r["id"] for r in store.list_records("ab", limit=100)] == written["ab"]  # "a" is not a prefix match
        assert [r["id"] for r in store.list_records("b", after=written["b"][20])] == written["b"][21:]
        assert store.list_records("nobody") == []
        assert store.list_records("a", limit=0) == []
        assert store.counts() == {s: counted(25, 0) for s in written}

    with_store(tmp_path / "db", body)


def test_consumed_records_leave_the_unconsumed_window(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        written: dict[str, list[str]] = {"a": [], "ab": [], "b": []}
        for i in range(8):
            for scenario in written:
                rec = record(scenario, i=i)
                await store.put_record(rec)
                written[scenario].append(rec["id"])
        assert [r["id"] for r in store.unconsumed("ab")] == written["ab"]  # neighbours' records are not mixed in
        await store.mark_consumed("ab", written["ab"][:3], "j-1")
        await store.mark_consumed("ab", written["ab"][5:6], "j-2")
        left = [written["ab"][i] for i in (3, 4, 6, 7)]
        assert [r["id"] for r in store.unconsumed("ab")] == left  # oldest first
        assert [r["id"] for r in store.unconsumed("ab", window=3)] == left[-2:]  # only the newest are looked at
        assert [r["id"] for r in store.unconsumed("b")] == written["b"]  # the last scenario in key order
        assert [r["id"] for r in store.unconsumed("a")] == written["a"]  # and the first
        assert store.unconsumed("nobody") == []

    with_store(tmp_path / "db", body)


def test_reported_records_stay_eligible_however_old(tmp_path: Path) -> None:
    """A reported record older than the window is still found (the `reported` index, itself looked at over its
    own newest `window`), until a candidate consumes it; a store written before the index existed gets it built
    when it opens."""
    async def write(store: RecordStore) -> list[str]:
        ids = []
        for i in range(10):
            rec = record("s1", i=i)
            await store.put_record(rec)
            ids.append(rec["id"])
        await store.put_report("s1", {"references": [ids[1], ids[2]], "score": 1.0})
        await store.put_report("s1", {"references": [ids[1]], "score": 0.0})  # a second report, one entry
        await store.put_record(record("s2"))
        assert [r["id"] for r in store.unconsumed("s1", window=3)] == [ids[1], ids[2], *ids[7:]]
        assert [len(r["reports"]) for r in store.unconsumed("s1", window=3)[:2]] == [2, 1]
        assert [r["id"] for r in store.unconsumed("s1", window=1)] == [ids[2], ids[9]]  # the newest reported
        await store.mark_consumed("s1", [ids[2], ids[8]], "j-1")
        assert [r["id"] for r in store.unconsumed("s1", window=3)] == [ids[1], ids[7], ids[9]]
        assert [r["id"] for r in store.unconsumed("s1", window=1)] == [ids[1], ids[9]]
        assert len(store.unconsumed("s2", window=1)) == 1  # another scenario's reports are not its own
        return ids

    ids = with_store(tmp_path / "db", write)
    env = lmdb.open(str(tmp_path / "db"), max_dbs=16)  # as a store from before the index: no table, no flag
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"reported", txn=txn), delete=True)
        txn.delete(b"reported_index", db=env.open_db(b"meta", txn=txn))
    env.close()

    async def reopened(store: RecordStore) -> None:
        assert [r["id"] for r in store.unconsumed("s1", window=1)] == [ids[1], ids[9]]  # ids[2]: consumed

    with_store(tmp_path / "db", reopened)


# --- reports ----------------------------------------------------------------------------------

def test_put_report_attaches_to_each_reference(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        first, second = record(), record()
        await store.put_record(first)
        await store.put_record(second)
        stored, created = await store.put_report(
            "s1", {"references": [first["id"], second["id"], first["id"]], "score": 1,
                   "feedback": "good", "metadata": {"user": "u1"}})
        assert created is True
        assert stored["report_id"].startswith("rpt_") and len(stored["report_id"]) == 30
        assert stored["score"] == 1.0 and isinstance(stored["score"], float)
        assert set(stored) == {"report_id", "scenario", "references", "score", "feedback", "metadata", "source",
                               "created_at"}
        assert stored["source"] == "client"
        later, _ = await store.put_report("s1", {"references": [first["id"]], "feedback": {"label": "meh"},
                                                 "report_id": "client-7"})
        assert later == {**later, "report_id": "client-7", "score": None, "metadata": None}
        assert reports_of(store, first["id"]) == [stored, later]  # oldest first
        assert reports_of(store, second["id"]) == [stored]
        assert store.list_records("s1")[0]["reports"] == [stored, later]
        assert store.get_report("s1", stored["report_id"]) == stored
        assert store.get_report("s1", "client-7") == later
        assert store.get_report("s1", "missing") is None
        assert store.get_report("s2", "client-7") is None  # report ids are per scenario
        assert store.counts() == {"s1": counted(2, 2)}

    with_store(tmp_path / "db", body)


def test_practice_records_and_verdicts_are_counted_apart_and_uncounted_when_deleted(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        served, practice = record(), [record(turn_kind="practice") for _ in range(3)]
        for rec in (served, *practice):
            await store.put_record(rec)
        await store.put_report("s1", {"references": [served["id"]], "score": 1.0})
        for rec in practice:
            await store.put_report("s1", {"references": [rec["id"]], "score": 0.0,
                                          "report_id": f"verifier-{rec['id']}"}, source="verifier")
        assert store.counts() == {"s1": counted(4, 4, 3, 3)}  # of every record and report, those of practice
        assert store.waiting("s1", 10) == 4 and store.waiting("s1", 2) == 2  # scored, not consumed yet
        await store.mark_consumed("s1", [practice[1]["id"]], "j-1")
        assert store.waiting("s1", 10) == 3
        assert await store.delete_records("s1", [practice[0]["id"], served["id"]]) == 2
        assert store.counts() == {"s1": counted(2, 2, 2, 2)} and store.waiting("s1", 10) == 1

    with_store(tmp_path / "db", body)


def test_report_with_unknown_or_foreign_receipt_writes_nothing(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        mine, theirs = record("s1"), record("s2")
        await store.put_record(mine)
        await store.put_record(theirs)
        for bad in (new_receipt(), theirs["id"], "garbage"):
            with pytest.raises(UnknownReceipt) as info:
                await store.put_report("s1", {"references": [mine["id"], bad], "report_id": "r1"})
            assert info.value.receipt == bad
        assert store.get_report("s1", "r1") is None
        assert reports_of(store, mine["id"]) == []
        assert store.counts() == {"s1": counted(1, 0), "s2": counted(1, 0)}

    with_store(tmp_path / "db", body)


def test_report_id_is_idempotent_for_the_same_body_and_conflicts_otherwise(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        rec = record()
        await store.put_record(rec)
        report = {"references": [rec["id"]], "score": 1, "feedback": "ok", "report_id": "retry-me"}
        stored, created = await store.put_report("s1", report)
        again, created_again = await store.put_report("s1", {**report, "score": 1.0})
        assert (created, created_again) == (True, False)
        assert again == stored  # the original, created_at included
        with pytest.raises(ReportConflict) as info:
            await store.put_report("s1", {**report, "score": 0.0})
        assert info.value.report_id == "retry-me"
        other = record("s2")
        await store.put_record(other)
        # report ids are per scenario: another scenario's "retry-me" is its own report, and changes nothing here
        theirs, created_there = await store.put_report("s2", {**report, "references": [other["id"]], "score": 0.0})
        assert created_there and store.get_report("s2", "retry-me") == theirs
        assert store.get_report("s1", "retry-me") == stored
        long_id = "ü" * 250  # 500 bytes of UTF-8: too long for an LMDB key as it is
        long_report, _ = await store.put_report("s1", {**report, "report_id": long_id})
        assert store.get_report("s1", long_id) == long_report and store.get_report("s2", long_id) is None
        assert [r["report_id"] for r in reports_of(store, rec["id"])] == ["retry-me", long_id]
        assert store.counts()["s1"]["reports"] == 2

    with_store(tmp_path / "db", body)


def test_a_report_stored_before_ids_were_per_scenario_still_answers_for_its_own_scenario(tmp_path: Path) -> None:
    """A store written by an older reefd keeps a report under its bare id: it is found, resent idempotently and
    conflicts as before within its scenario, and another scenario may use the id for its own report."""
    rec, other = record("s1"), record("s2")

    async def seed(store: RecordStore) -> None:
        await store.put_record(rec)
        await store.put_record(other)

    with_store(tmp_path / "db", seed)
    old = {"report_id": "legacy-1", "scenario": "s1", "references": [rec["id"]], "score": 1.0, "feedback": None,
           "metadata": None, "source": "client", "created_at": 1.0}
    env = lmdb.open(str(tmp_path / "db"), subdir=True, max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"legacy-1", pack(old), db=env.open_db(b"reports", txn=txn))
    env.close()

    async def body(store: RecordStore) -> None:
        assert store.get_report("s1", "legacy-1") == old
        assert store.get_report("s2", "legacy-1") is None
        again, created = await store.put_report("s1", {"references": [rec["id"]], "score": 1, "report_id": "legacy-1"})
        assert (again, created) == (old, False)
        with pytest.raises(ReportConflict):
            await store.put_report("s1", {"references": [rec["id"]], "score": 0, "report_id": "legacy-1"})
        theirs, created = await store.put_report("s2", {"references": [other["id"]], "report_id": "legacy-1"})
        assert created and store.get_report("s2", "legacy-1") == theirs

    with_store(tmp_path / "db", body)


def test_the_first_report_keeps_a_claim_and_the_others_store_nothing(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        a, b = record(), record()
        await store.put_record(a)
        await store.put_record(b)
        first = {"references": [a["id"]], "score": 1, "report_id": "first"}
        await store.put_report("s1", first, claims=["grid/00000000/0/0", f"attempt/{a['id']}"])
        # two writers racing for one key in the same batch: exactly one wins
        results = await asyncio.gather(
            store.put_report("s1", {"references": [b["id"]], "score": 2, "report_id": "x"}, claims=["grid/1/0"]),
            store.put_report("s1", {"references": [b["id"]], "score": 3, "report_id": "y"}, claims=["grid/1/0"]),
            return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["ClaimTaken", "tuple"]
        with pytest.raises(ClaimTaken) as info:
            await store.put_report("s1", {"references": [b["id"]], "score": 5, "report_id": "late"},
                                   claims=["grid/00000000/0/0"])
        assert (info.value.claim, info.value.holder) == ("grid/00000000/0/0", "first")
        assert store.get_report("s1", "late") is None
        assert [r["report_id"] for r in reports_of(store, a["id"])] == ["first"]
        assert (await store.put_report("s1", first, claims=["grid/00000000/0/0"]))[1] is False  # a resend
        assert store.claimed("s1", "grid/00000000/") == {"grid/00000000/0/0": "first"}
        assert store.claimed("s2", "grid/") == {}  # claims are per scenario

    with_store(tmp_path / "db", body)


def test_a_failing_op_fails_alone_in_its_batch(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        base = record()
        await store.put_record(base)
        await store.put_report("s1", {"references": [base["id"]], "report_id": "taken", "score": 1.0})
        good = [record() for _ in range(50)]
        commits = store.stats["commits"]
        results = await asyncio.gather(
            *(store.put_record(r) for r in good[:25]),
            store.put_report("s1", {"references": [new_receipt()]}),
            store.put_report("s1", {"references": [base["id"]], "report_id": "taken", "score": 0.0}),
            store.put_record(base),
            store.put_record(record(unserialisable={1, 2})),
            *(store.put_record(r) for r in good[25:]),
            return_exceptions=True)
        assert [type(x).__name__ for x in results[25:29]] == [
            "UnknownReceipt", "ReportConflict", "ValueError", "TypeError"]
        assert all(x is False for x in results[:25] + results[29:])  # stored (no turn to link)
        assert store.stats["commits"] - commits < 10  # they shared batches: the failures stayed their own
        assert all(store.get_record(r["id"]) is not None for r in good)
        assert store.counts() == {"s1": counted(51, 1)}

    with_store(tmp_path / "db", body)


# --- group commit, growth, failure, close --------------------------------------------------------

def test_concurrent_puts_are_durable_and_grouped(tmp_path: Path) -> None:
    recs = [record(f"s{i % 3}", i=i) for i in range(1000)]

    async def body(store: RecordStore) -> dict[str, int]:
        await asyncio.gather(*(store.put_record(r) for r in recs))
        return dict(store.stats)

    stats = with_store(tmp_path / "db", body)
    assert stats["ops"] == 1000
    assert stats["commits"] <= 250, stats  # 1,000 fsyncs without grouping; batches form while one commits
    assert stats["largest_batch"] > 20, stats

    async def check(store: RecordStore) -> None:  # a fresh env: what was acknowledged is on disk
        assert all(store.get_record(r["id"]) == {**r, "reports": []} for r in recs)
        assert store.counts() == {"s0": counted(334, 0), "s1": counted(333, 0),
                                  "s2": counted(333, 0)}

    with_store(tmp_path / "db", check)


def test_full_map_grows_and_keeps_every_write(tmp_path: Path) -> None:
    recs = [record(pad=noise(3000)) for _ in range(800)]  # ~3.2 MB stored into a 64 KiB map

    async def body(store: RecordStore) -> dict[str, int]:
        stop, reads = threading.Event(), [0]

        def reader() -> None:  # reads from another thread while the writer resizes the map
            while not stop.is_set():
                assert store.get_record(recs[0]["id"]) in (None, {**recs[0], "reports": []})
                store.list_records("s1", limit=5)
                reads[0] += 1

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for chunk in range(0, len(recs), 100):  # concurrent batches and lone writes both hit a full map
                await asyncio.gather(*(store.put_record(r) for r in recs[chunk:chunk + 100]))
                store.counts()
            await store.put_record(recs[0] | {"id": new_receipt()})
        finally:
            stop.set()
            thread.join()
        assert reads[0] > 0
        assert all(store.get_record(r["id"]) is not None for r in recs)
        return dict(store.stats)

    stats = with_store(tmp_path / "db", body, map_size=64 * 1024, max_batch=64)
    assert stats["grows"] >= 5, stats
    assert stats["ops"] == 801

    async def counts(store: RecordStore) -> dict[str, dict[str, int]]:
        return store.counts()

    assert with_store(tmp_path / "db", counts) == {"s1": counted(801, 0)}


def test_storage_error_when_the_map_cannot_grow_and_reads_still_work(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        kept = record()
        await store.put_record(kept)
        with pytest.raises(StorageError, match="max_grow"):
            for _ in range(200):
                await store.put_record(record(pad=noise(20000)))
        failures = await asyncio.gather(*(store.put_record(record(pad=noise(20000))) for _ in range(10)),
                                        return_exceptions=True)
        assert all(isinstance(f, StorageError) for f in failures)
        assert store.get_record(kept["id"]) == {**kept, "reports": []}
        counted = store.counts()["s1"]["records"]
        assert counted == len(store.list_records("s1", limit=1000))  # nothing half-written
        store._max_grow = 8 << 20  # room appears (disk freed, limit raised): the same store writes again
        big = record(pad=noise(20000))
        await store.put_record(big)
        assert store.get_record(big["id"]) is not None
        assert store.counts()["s1"]["records"] == counted + 1

    with_store(tmp_path / "db", body, map_size=256 * 1024, max_grow=512 * 1024)


def test_close_drains_queued_writes_then_refuses(tmp_path: Path) -> None:
    recs = [record() for _ in range(300)]

    async def main() -> None:
        store = RecordStore(tmp_path / "db")
        with pytest.raises(StoreClosed):
            await store.put_record(record())
        await store.close()  # closing a store that never opened is a no-op
        await store.open()
        tasks = [asyncio.create_task(store.put_record(r)) for r in recs]
        await asyncio.sleep(0)  # every task has queued its write
        await asyncio.gather(store.close(), store.close())
        assert all(t.done() and t.exception() is None for t in tasks)
        with pytest.raises(StoreClosed, match="closed"):
            await store.put_record(record())
        with pytest.raises(StoreClosed):
            store.get_record(recs[0]["id"])
        await store.close()

        again = RecordStore(tmp_path / "db")
        await again.open()
        assert all(again.get_record(r["id"]) is not None for r in recs)
        await again.close()

    asyncio.run(main())


# --- crash safety: kill -9 mid-stream ---------------------------------------------------------------

CHILD = r"""
import asyncio, base64, os, sys
from reefd.observe.records import RecordStore, new_receipt

async def main(path):
    store = RecordStore(path, map_size=64 * 1024)  # small: the map also grows while we are killed
    await store.open()

    async def client(k):
        while True:
            receipt = new_receipt()
            pad = base64.b64encode(os.urandom(1500)).decode()
            await store.put_record({"id": receipt, "scenario": "crash", "client": k, "pad": pad})
            sys.stdout.write(receipt + "\n")  # only after put_record returned
            sys.stdout.flush()

    await asyncio.gather(*(client(k) for k in range(32)))

asyncio.run(main(sys.argv[1]))
"""


def test_every_acknowledged_record_survives_kill_9(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "db")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert child.stdout is not None and child.stderr is not None
    lines: list[str] = []
    try:
        while len(lines) < 2000:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"writer died early: {child.stderr.read()}")
            lines.append(line)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    lines += child.stdout.read().splitlines(keepends=True)  # what it printed before the kill landed
    child.stdout.close()
    child.stderr.close()
    receipts = [line[:26] for line in lines if line.endswith("\n") and len(line) == 27]
    assert len(receipts) >= 2000

    async def check(store: RecordStore) -> None:
        missing = [r for r in receipts if store.get_record(r) is None]
        assert missing == []
        assert store.counts()["crash"]["records"] >= len(receipts)
        assert store.counts()["crash"]["records"] == len(store.list_records("crash", limit=10**6))

    with_store(tmp_path / "db", check)


def test_a_failed_write_on_a_full_disk_says_no_space_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMDB reports a full disk as EIO ("Input/output error"): the message names the full disk instead."""
    import errno
    import os

    from reefd.observe.groupcommit import disk_says

    eio = OSError(errno.EIO, "Input/output error")
    assert disk_says(str(tmp_path), eio) == "[Errno 5] Input/output error"  # plenty of room here
    full = os.statvfs_result((4096, 4096, 1000, 10, 10, 100, 0, 0, 0, 255, 0))  # 40 KiB free
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    assert disk_says(str(tmp_path), eio) == "no space left on device (0 MiB free; [Errno 5] Input/output error)"
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert disk_says("/nonexistent/x", enospc).startswith("no space left on device")
