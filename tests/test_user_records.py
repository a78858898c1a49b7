"""A per-user scenario's records in the store: each user's records and reports counted in the write transaction
(and uncounted when deleted), listed by user, and never mistaken for a scenario in the scenarios' counts."""

from __future__ import annotations

from pathlib import Path

from reefd.observe.records import RecordStore
from tests.test_records import counted, record, with_store


def test_each_users_records_and_reports_are_counted_and_uncounted_when_deleted(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        alice = [record(user="alice") for _ in range(3)]
        bob, nobody = record(user="bob@example.com"), record()
        for rec in (*alice, bob, nobody):
            await store.put_record(rec)
        await store.put_report("s1", {"references": [alice[0]["id"], alice[1]["id"]], "score": 1.0}, user="alice")
        await store.put_report("s1", {"references": [nobody["id"]], "score": 0.0})
        assert store.counts() == {"s1": counted(5, 2)}  # the users' counts are not scenarios
        assert store.user_counts("s1") == {"alice": {"records": 3, "reports": 1},
                                           "bob@example.com": {"records": 1, "reports": 0}}
        assert store.user_counts("s2") == {}
        mine = store.list_records("s1", limit=10, user="alice")
        assert [r["id"] for r in mine] == [r["id"] for r in alice]
        assert await store.delete_records("s1", [alice[0]["id"]]) == 1
        assert store.user_counts("s1")["alice"] == {"records": 2, "reports": 1}  # the report keeps alice[1]
        assert await store.delete_records("s1", [alice[1]["id"], bob["id"]]) == 2
        assert store.user_counts("s1") == {"alice": {"records": 1, "reports": 0},
                                           "bob@example.com": {"records": 0, "reports": 0}}

    with_store(tmp_path / "db", body)


def test_deleting_a_user_compacts_the_file_and_the_store_goes_on(tmp_path: Path) -> None:
    """After a user's deletion nothing of theirs is in the LMDB file, not even in its free pages; everyone
    else's records read whole, and the store takes writes and reports as before."""

    async def body(store: RecordStore) -> None:
        secret = "zq-" + "dora's words " * 200
        theirs = [record(user="dora", note=secret) for _ in range(20)]
        kept = [record(user="alice", note="alice keeps this") for _ in range(5)]
        for rec in (*theirs, *kept):
            await store.put_record(rec)
        await store.put_report("s1", {"references": [theirs[0]["id"]], "score": 1.0}, user="dora")
        assert await store.delete_user("s1", "dora") == 20
        data = (tmp_path / "db" / "data.mdb").read_bytes()
        assert b"dora" not in data and theirs[0]["id"].encode() not in data
        assert [r["id"] for r in store.list_records("s1", limit=10)] == [r["id"] for r in kept]
        assert store.user_counts("s1") == {"alice": {"records": 5, "reports": 0}}
        late = record(user="alice")
        await store.put_record(late)
        await store.put_report("s1", {"references": [late["id"]], "score": 0.5}, user="alice")
        assert store.user_counts("s1")["alice"] == {"records": 6, "reports": 1}

    with_store(tmp_path / "db", body)
