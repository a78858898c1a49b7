"""The durable record store: records with their indexes (scenario, session, links, consumed), reads and retention
deletes; reports from report_store.py, durability from groupcommit.py. Knows nothing of HTTP, provider formats,
engines or recipes: a record is an opaque JSON object with "id" and "scenario" (encoded by recordcodec)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Collection, Iterator
from itertools import islice
from typing import Any

import lmdb

from reefd.observe import piecetable
from reefd.observe.groupcommit import COUNTS, StorageError, StoreClosed, practice_key, scenario_key, user_key
from reefd.observe.receipts import is_receipt, new_receipt, receipt_ms
from reefd.observe.recordcodec import unpack
from reefd.observe.report_store import ClaimTaken, ReportConflict, Reports, UnknownReceipt

__all__ = ["ClaimTaken", "RecordStore", "ReportConflict", "StorageError", "StoreClosed", "UnknownReceipt",
           "new_receipt"]


PRACTICE_FILTERS = ("include", "exclude", "only")
LOOP_TURNS = "tinker"  # the turn_kind of what a training loop of its own sampled (the Tinker API's samples)


def kept(record: dict[str, Any], practice: str, user: str | None = None) -> bool:
    """Whether a listing that includes, excludes or only wants practice records (reefd's own), and only `user`'s
    records when it names one, keeps `record`."""
    return (user is None or record.get("user") == user) and \
        (practice == "include" or (record.get("turn_kind") == "practice") == (practice == "only"))


def _session_prefix(scenario: bytes, session: str) -> bytes:
    """scenario NUL digest: sessions are free-form strings, index keys must stay short."""
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return scenario + b"\0" + digest


class RecordStore(Reports):
    """Records and reports in one LMDB env. Writes are group-committed by one thread; reads are inline."""

    TABLES = ("records", "by_scenario", "by_session", "reports", "report_index", "counts", "meta", "consumed",
              "reported", "links", "claims", "by_user", *piecetable.TABLES)

    def __init__(self, path: str | os.PathLike[str], *, whole: bool = False, **options: Any) -> None:
        """`whole`: write each record as one value, as stores did before pieces (benchmarks compare the two)."""
        super().__init__(path, **options)
        self._selecting: dict[str, asyncio.Lock] = {}
        self.whole = whole

    # --- writes: enqueue, then wait for the batch's commit ----------------------------------

    async def put_record(self, record: dict[str, Any], next_state: list[dict[str, Any]] | None = None, *,
                         link: bool = True) -> bool:
        """Store one record; returns once it is durable. Raises StorageError when it cannot be.

        A record whose `previous` names an earlier turn links that turn to it in the same transaction: the earlier
        record then shows `next` (this receipt) and `next_state` (the messages that followed its reply). The first
        record to link a turn keeps the link; returns whether this one did (False when there was nothing to link).

        The writer thread serialises the record (JSON + zlib, off the event loop), so it must not
        change until this returns; a TypeError for a value JSON cannot hold is raised here.
        """
        receipt = record.get("id")
        if not is_receipt(receipt):
            raise ValueError(f"record id must be a receipt from new_receipt(), got {receipt!r}")
        scenario = scenario_key(record.get("scenario"))
        to_link = None  # link=False: a record that must not continue its turn (a failed stream)
        previous = record.get("previous")
        if link and is_receipt(previous):
            to_link = (str(previous).encode(), {"next": receipt, "next_state": next_state or []})
        linked: bool = await self._submit(self._apply_record, str(receipt).encode(), scenario, record, to_link)
        self._written(record["scenario"])
        return linked

    def _apply_record(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]], receipt: bytes,
                      scenario: bytes, record: dict[str, Any], link: tuple[bytes, dict[str, Any]] | None) -> bool:
        if txn.get(receipt, db=self._dbs["records"]) is not None:
            raise ValueError(f"receipt {receipt.decode()} is already stored")
        txn.put(receipt, piecetable.encode(txn, self._dbs, record, self.whole), db=self._dbs["records"])
        txn.put(scenario + b"\0" + receipt, b"", db=self._dbs["by_scenario"])
        if isinstance(record.get("session"), str):
            txn.put(_session_prefix(scenario, record["session"]) + receipt, b"", db=self._dbs["by_session"])
        deltas.setdefault(scenario, [0, 0])[0] += 1
        if record.get("turn_kind") == "practice":
            deltas.setdefault(practice_key(scenario), [0, 0])[0] += 1
        if isinstance(user := record.get("user"), str):
            txn.put(user_key(scenario, user) + b"\0" + receipt, b"", db=self._dbs["by_user"])
            deltas.setdefault(user_key(scenario, user), [0, 0])[0] += 1
        if link is not None and txn.get(link[0], db=self._dbs["records"]) is not None \
                and txn.get(link[0], db=self._dbs["links"]) is None:
            txn.put(link[0], piecetable.encode(txn, self._dbs, link[1], self.whole), db=self._dbs["links"])
            return True
        return False

    async def mark_consumed(self, scenario: str, receipts: list[str], by: str) -> None:
        """Record that a job's candidate (`by`) consumed these records: recipes never see them again. Durable."""
        await self._submit(self._apply_consumed, scenario_key(scenario), list(receipts), by.encode())

    def _apply_consumed(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                        scenario: bytes, receipts: list[str], by: bytes) -> None:
        for receipt in receipts:
            if txn.get(receipt.encode(), db=self._dbs["records"]) is None:  # deleted by retention meanwhile
                continue
            key = scenario + b"\0" + receipt.encode()
            txn.put(key, by, overwrite=False, db=self._dbs["consumed"])
            txn.delete(key, db=self._dbs["reported"])

    def unconsumed(self, scenario: str, *, window: int = 20_000) -> list[dict[str, Any]]:
        """Records of `scenario` (with their reports) that no candidate has consumed yet, in receipt order: the
        `window` most recent records, and the `window` most recent of those with a report (the `reported` index),
        however old. So a backlog of records nobody reports neither hides a reported one nor makes every look
        longer, and reported records a recipe never takes (no token ids, no score) cannot either."""
        prefix = scenario_key(scenario) + b"\0"
        with self._reading() as txn:
            keys = {key for table in ("reported", "by_scenario")
                    for key in islice(self._newest(txn, table, prefix), window)}
            out = []
            for key in sorted(keys):  # receipt order: receipts sort by creation time
                if txn.get(key, db=self._dbs["consumed"]) is None:
                    record = self._load_record(txn, key[len(prefix):])
                    if record is not None and record.get("turn_kind") != "shadow":  # never served: never trained on
                        out.append(record)
        return out

    def waiting(self, scenario: str, at_most: int) -> int:
        """How many of the scenario's records have a report that no candidate consumed yet, counting at most
        `at_most` (the `reported` index): the scored experience waiting for a Grow job."""
        prefix = scenario_key(scenario) + b"\0"
        with self._reading() as txn:
            return sum(1 for _ in islice(self._newest(txn, "reported", prefix), at_most))

    # --- retention: records deleted in bounded batches ----------------------------------------

    def selecting(self, scenario: str) -> asyncio.Lock:
        """Held while a scenario's batch is chosen (the runner) and while its records are deleted (retention), so
        that a job never takes a record being deleted: once the lock is free, the job's receipts are known."""
        return self._selecting.setdefault(scenario, asyncio.Lock())

    def expired(self, scenario: str, *, before_ms: int | None, max_records: int | None, keep: Collection[str],
                after: str | None = None, limit: int = 1000) -> tuple[list[str], str | None]:
        """Up to `limit` receipts to delete, oldest first, from after `after`: created before `before_ms`, or beyond
        the newest `max_records` of the scenario's records outside `keep`; never one in `keep` (kept records do not
        count against max_records, so lineage that grows with every release never crowds out new records). Also
        returns where a next call goes on from (None: nothing more to delete)."""
        prefix = scenario_key(scenario) + b"\0"
        picked: list[str] = []
        with self._reading() as txn:
            over = 0
            if max_records is not None:
                raw = txn.get(prefix[:-1], db=self._dbs["counts"])
                by_scenario = self._dbs["by_scenario"]
                kept = sum(txn.get(prefix + r.encode("utf-8", "surrogatepass"), db=by_scenario) is not None
                           for r in keep)
                over = (COUNTS.unpack(raw)[0] if raw else 0) - kept - max_records
            for key in self._after(txn, "by_scenario", prefix, after):
                receipt = key.decode()
                if receipt in keep:
                    continue
                old = before_ms is not None and receipt_ms(receipt) < before_ms
                if not old and over - len(picked) <= 0:  # only younger ones follow: none is old
                    break
                picked.append(receipt)
                if len(picked) >= limit:
                    return picked, receipt
        return picked, None

    async def delete_records(self, scenario: str, receipts: list[str]) -> int:
        """Delete these records of `scenario` with their index entries, in one durable transaction (callers keep
        batches small: writes queued meanwhile wait for it, ~50 us a record). A report goes with the last record it
        references; one that still references a kept record stays as it was reported. Claims stay taken. Returns
        how many records were deleted (receipts not found, or of another scenario, are skipped)."""
        return int(await self._submit(self._apply_delete, scenario_key(scenario), list(receipts)))

    async def delete_user(self, scenario: str, user: str, batch: int = 250) -> int:
        """Delete every record of `user` in `scenario` (their reports go with them, as for `delete_records`) and
        their counts, then compact the file (nothing of theirs stays in its free pages). Returns how many."""
        total = 0
        while receipts := await asyncio.to_thread(self.user_receipts, scenario, user, batch):
            deleted = await self.delete_records(scenario, receipts)
            total += deleted
            if not deleted:
                break  # index entries without their records: _apply_forget takes them
        await self._submit(self._apply_forget, user_key(scenario_key(scenario), user))
        await asyncio.to_thread(self.compact)
        return total

    def user_receipts(self, scenario: str, user: str, limit: int | None = None) -> list[str]:
        """The receipts of `user`'s records in `scenario`, oldest first, from the `by_user` index alone."""
        prefix = user_key(scenario_key(scenario), user) + b"\0"
        with self._reading() as txn:
            return [k.decode() for k in islice(self._after(txn, "by_user", prefix, None), limit)]

    def _apply_forget(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]], key: bytes) -> None:
        """A user's counts, and whatever index entries of theirs are left, gone."""
        txn.delete(key, db=self._dbs["counts"])
        deltas.pop(key, None)
        with txn.cursor(db=self._dbs["by_user"]) as cursor:
            found = cursor.set_range(key + b"\0")
            while found and cursor.key().startswith(key + b"\0"):
                found = cursor.delete()

    def _apply_delete(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                      scenario: bytes, receipts: list[str]) -> int:
        db, prefix = self._dbs, scenario + b"\0"
        # First read everything the deletion needs, so that a value that cannot be read fails the op before any
        # write (the writer's rule for op errors); each report is read once however many of its records go.
        rows: list[tuple[bytes, Any, bool, Any]] = []  # (receipt, session, practice, user)
        reports: dict[bytes, tuple[list[Any], bool, Any]] = {}  # report key -> its references, a verifier's, user
        for receipt in dict.fromkeys(receipts):
            key = receipt.encode()
            raw = txn.get(key, db=db["records"])
            if raw is None or txn.get(prefix + key, db=db["by_scenario"]) is None:
                continue
            record = piecetable.fields(raw)
            rows.append((key, record.get("session"), record.get("turn_kind") == "practice", record.get("user")))
            with txn.cursor(db=db["report_index"]) as cursor:  # receipt + seq -> report key
                for index_key, report_key in cursor if cursor.set_range(key) else ():
                    if not index_key.startswith(key):
                        break
                    if report_key not in reports and (stored := txn.get(report_key, db=db["reports"])) is not None:
                        report = unpack(stored)
                        reports[report_key] = (list(report.get("references") or []),
                                               report.get("source") == "verifier", report.get("user"))
        for key, session, _, user in rows:
            txn.delete(prefix + key, db=db["by_scenario"])
            if isinstance(user, str):
                txn.delete(user_key(scenario, user) + b"\0" + key, db=db["by_user"])
                deltas.setdefault(user_key(scenario, user), [0, 0])[0] -= 1
            if isinstance(session, str):
                txn.delete(_session_prefix(scenario, session) + key, db=db["by_session"])
            for table in ("records", "links"):
                if (stored := txn.get(key, db=db[table])) is not None:
                    piecetable.release(txn, db, stored)  # its pieces go with the last record that needs them
                    txn.delete(key, db=db[table])
            for table in ("consumed", "reported"):
                txn.delete(prefix + key, db=db[table])
            with txn.cursor(db=db["report_index"]) as cursor:
                found = cursor.set_range(key)
                while found and cursor.key().startswith(key):
                    found = cursor.delete()  # moves on to the next entry
        delta, practice = deltas.setdefault(scenario, [0, 0]), deltas.setdefault(practice_key(scenario), [0, 0])
        for report_key, (refs, verdict, user) in reports.items():  # a report goes with the last record it references
            if not any(txn.get(str(ref).encode(), db=db["records"]) for ref in refs):
                txn.delete(report_key, db=db["reports"])
                delta[1] -= 1
                practice[1] -= verdict
                if isinstance(user, str):
                    deltas.setdefault(user_key(scenario, user), [0, 0])[1] -= 1
        delta[0] -= len(rows)
        practice[0] -= sum(p for _, _, p, _ in rows)
        return len(rows)

    # --- reads: synchronous, short read transactions ----------------------------------------

    def _after(self, txn: lmdb.Transaction[bytes], table: str, prefix: bytes, after: str | None) -> Iterator[bytes]:
        """The receipts of `table` under `prefix` strictly after `after`, in receipt order."""
        start = prefix + (after or "").encode("utf-8", "surrogatepass")
        cursor = txn.cursor(db=self._dbs[table])  # ends with the transaction
        for key in cursor.iternext(values=False) if cursor.set_range(start) else ():
            if not key.startswith(prefix):
                return
            if key != start:
                yield key[len(prefix):]

    def _newest(self, txn: lmdb.Transaction[bytes], table: str, prefix: bytes) -> Iterator[bytes]:
        """The keys of `table` under `prefix`, newest first."""
        cursor = txn.cursor(db=self._dbs[table])  # ends with the transaction
        # the newest key: just before the first key past the prefix (or the last of all)
        found = (cursor.set_range(prefix + b"\xff") and cursor.prev()) or cursor.last()
        while found and cursor.key().startswith(prefix):
            yield cursor.key()
            found = cursor.prev()

    def get_record(self, receipt: str) -> dict[str, Any] | None:
        """The record with its "reports" (oldest first), or None."""
        if not is_receipt(receipt):
            return None
        with self._reading() as txn:
            return self._load_record(txn, receipt.encode())

    def list_records(self, scenario: str, *, after: str | None = None, limit: int = 50,
                     session: str | None = None, practice: str = "include",
                     user: str | None = None) -> list[dict[str, Any]]:
        """Records of one scenario (or of one session in it) in receipt order, strictly after
        `after`, each with its reports; `practice`: include, exclude or only reefd's practice records; `user`: that
        user's records only."""
        if session is None and user is not None:  # one user's records, by their index
            prefix, table = user_key(scenario_key(scenario), user) + b"\0", "by_user"
        elif session is None:
            prefix, table = scenario_key(scenario) + b"\0", "by_scenario"
        else:
            prefix, table = _session_prefix(scenario_key(scenario), session), "by_session"
        if len(prefix) + len((after or "").encode("utf-8", "surrogatepass")) > 400:
            raise ValueError("`after` is too long to be a receipt")
        found: list[dict[str, Any]] = []
        with self._reading() as txn:
            for receipt in self._after(txn, table, prefix, after):
                if len(found) >= limit:
                    break
                if (record := self._load_record(txn, receipt)) is not None and kept(record, practice, user):
                    found.append(record)
        return found

    def export_page(self, scenario: str, after: str | None, *, limit: int = 100, reported_only: bool = False,
                    scan: int = 10_000, practice: str = "include",
                    user: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """Up to `limit` records of `scenario` (with their reports) strictly after `after`, in receipt order, looking
        at no more than `scan` keys; with `reported_only`, those with a report; `practice` as for list_records.
        Returns them and the receipt a next page goes on after, or None when the scenario has no more."""
        found: list[dict[str, Any]] = []
        with self._reading() as txn:
            for seen, receipt in enumerate(self._after(txn, "by_scenario", scenario_key(scenario) + b"\0", after), 1):
                wanted = not reported_only or self._has_report(txn, receipt)
                if wanted and (record := self._load_record(txn, receipt)) is not None and kept(record, practice, user):
                    found.append(record)
                if len(found) >= limit or seen >= scan:
                    return found, receipt.decode()
        return found, None

    def _has_report(self, txn: lmdb.Transaction[bytes], receipt: bytes) -> bool:
        with txn.cursor(db=self._dbs["report_index"]) as cursor:
            return cursor.set_range(receipt) and cursor.key().startswith(receipt)

    def recent(self, scenario: str, since: float, limit: int = 20_000) -> list[dict[str, Any]]:
        """The scenario's records created at or after `since` (at most `limit`), oldest first, without reports."""
        prefix = scenario_key(scenario) + b"\0"
        out: list[dict[str, Any]] = []
        with self._reading() as txn:
            for key in self._newest(txn, "by_scenario", prefix):
                if len(out) >= limit:
                    break
                raw = txn.get(key[len(prefix):], db=self._dbs["records"])
                if raw is not None:
                    record = piecetable.decode(txn, self._dbs, raw)
                    if float(record.get("created_at") or 0) < since:
                        break
                    out.append(record)
        return out[::-1]

    def _load_record(self, txn: lmdb.Transaction[bytes], receipt: bytes) -> dict[str, Any] | None:
        raw = txn.get(receipt, db=self._dbs["records"])
        if raw is None:
            return None
        record: dict[str, Any] = piecetable.decode(txn, self._dbs, raw)
        link = txn.get(receipt, db=self._dbs["links"])
        if link is not None:
            record.update(piecetable.decode(txn, self._dbs, link))
        reports = []
        with txn.cursor(db=self._dbs["report_index"]) as cursor:
            for key, report_key in cursor if cursor.set_range(receipt) else ():  # receipt + seq -> report
                if not key.startswith(receipt):
                    break
                if (stored := txn.get(report_key, db=self._dbs["reports"])) is not None:
                    reports.append(unpack(stored))
        record["reports"] = reports
        return record
