"""The durable record store: records and reports in LMDB, written by one group-commit thread.

Owns keys, indexes, counters and durability (values are encoded by recordcodec). Knows nothing of HTTP,
provider formats, engines or recipes: a record is an opaque JSON object with "id" and "scenario".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import lmdb

from reefd.observe.receipts import is_receipt as _is_receipt
from reefd.observe.receipts import new_receipt, receipt_ms
from reefd.observe.recordcodec import pack as _pack
from reefd.observe.recordcodec import unpack as _unpack

log = logging.getLogger("reefd.observe.records")

__all__ = ["ClaimTaken", "RecordStore", "ReportConflict", "StorageError", "StoreClosed", "UnknownReceipt",
           "new_receipt"]


LOW_DISK = 64 << 20  # free bytes under which a failed write is taken for a full disk


def disk_says(path: str, exc: BaseException) -> str:
    """A write error as the disk explains it: a full disk often surfaces from LMDB's msync or fsync as EIO
    ("Input/output error"), which names the symptom, not the cause."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return str(exc)
    free = stat.f_bavail * stat.f_frsize
    if getattr(exc, "errno", None) == errno.ENOSPC or free < LOW_DISK:
        return f"no space left on device ({free >> 20} MiB free; {exc})"
    return str(exc)


class StorageError(Exception):
    """A write could not be made durable (disk full, map cannot grow, store closed)."""


class StoreClosed(StorageError):
    """The store is closed (or was never opened): nothing more can be read or written."""


class UnknownReceipt(Exception):
    """A report references a receipt that does not exist or belongs to another scenario."""

    def __init__(self, receipt: str, scenario: str = "") -> None:
        super().__init__(f"unknown receipt {receipt!r} for this scenario")
        self.receipt, self.scenario = receipt, scenario


class ReportConflict(Exception):
    """A report_id is already stored with a different body."""

    def __init__(self, report_id: str) -> None:
        super().__init__(f"report {report_id!r} already exists with a different body")
        self.report_id = report_id


class ClaimTaken(Exception):
    """A report claims a key (a grid coordinate) that another report already holds: the first one keeps it."""

    def __init__(self, claim: str, holder: str) -> None:
        super().__init__(f"{claim} is already reported by {holder!r}")
        self.claim, self.holder = claim, holder


def _session_prefix(scenario: bytes, session: str) -> bytes:
    """scenario NUL digest: sessions are free-form strings, index keys must stay short."""
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return scenario + b"\0" + digest


def _scenario_key(scenario: object) -> bytes:
    key = scenario.encode() if isinstance(scenario, str) else b""
    if not key or b"\0" in key or len(key) > 256:
        raise ValueError(f"scenario must be a non-empty name without NUL, at most 256 bytes: {scenario!r}")
    return key


def _report_key(scenario: bytes, report_id: str) -> bytes:
    """0xfe, scenario NUL id: report_ids are per scenario, so one scenario's ids never answer for another's.
    A key too long for LMDB is hashed (0xfd). Neither byte occurs in UTF-8, so these keys never meet the bare ids
    that a store written before kept (see _legacy_report_key)."""
    key = scenario + b"\0" + report_id.encode("utf-8", "surrogatepass")
    return b"\xfe" + key if len(key) <= 400 else b"\xfd" + hashlib.sha256(key).digest()


def _legacy_report_key(report_id: str) -> bytes:
    """Where a store written before report_ids were per scenario kept a report: the id itself, or 0xff and its
    SHA-256 when too long. Such a report still answers for its own scenario."""
    key = report_id.encode("utf-8", "surrogatepass")
    return key if len(key) <= 256 else b"\xff" + hashlib.sha256(key).digest()


def _canonical(report: dict[str, Any]) -> str:
    """What makes two reports with one report_id "the same" (ids, timestamps aside)."""
    keys = ("scenario", "references", "score", "feedback", "metadata")
    same = {k: report.get(k) for k in keys} | {"source": report.get("source") or "client"}  # older: no source
    return json.dumps(same, sort_keys=True, separators=(",", ":"))


_COUNTS = struct.Struct(">QQ")  # records, reports
_SEQ = struct.Struct(">Q")
_STOP = object()
# raised before any put
_OP_ERRORS = (UnknownReceipt, ReportConflict, ClaimTaken, ValueError, TypeError, RecursionError)
Outcome = tuple[bool, Any]  # (True, result) or (False, exception)
Op = tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]


class _RWLock:
    """Many readers or one writer (the map resize); a waiting writer holds new readers back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = self._writers = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writers)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:  # held throughout: new readers queue on it
            self._writers += 1
            try:
                self._cond.wait_for(lambda: not self._readers)
                yield
            finally:
                self._writers -= 1
                self._cond.notify_all()


class RecordStore:
    """Records and reports in one LMDB env. Writes are group-committed by one thread; reads are inline."""

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = 1 << 30, max_batch: int = 1024,
                 max_grow: int = 1 << 40) -> None:
        self.path = os.fspath(path)
        self._map_size, self._max_batch, self._max_grow = map_size, max_batch, max_grow
        self._env: lmdb.Environment | None = None
        self._dbs: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._rw = _RWLock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self.stats = {"commits": 0, "ops": 0, "grows": 0, "largest_batch": 0}
        self._listeners: list[Callable[[str], None]] = []
        self._report_listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._selecting: dict[str, asyncio.Lock] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the folder, open the env and its tables, start the writer thread."""
        if self._thread is not None:
            raise RuntimeError("RecordStore.open() called twice")
        os.makedirs(self.path, exist_ok=True)
        env = lmdb.open(self.path, map_size=self._map_size, subdir=True, max_dbs=16,
                        sync=True, metasync=True, writemap=False)
        with env.begin(write=True) as txn:
            for name in ("records", "by_scenario", "by_session", "reports", "report_index", "counts", "meta",
                         "consumed", "reported", "links", "claims"):
                self._dbs[name] = env.open_db(name.encode(), txn=txn)
            needs_index = txn.get(b"reported_index", db=self._dbs["meta"]) is None
        if needs_index:  # a store from before the index: built once, off the event loop
            await asyncio.to_thread(self._build_reported_index, env)
        self._env, self._loop = env, asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._thread = threading.Thread(target=self._writer_main, name="reef-records-writer", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Let every write queued so far commit durably, stop the writer, close the env. Idempotent."""
        if self._thread is None:
            return
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._closing)

    async def _shutdown(self) -> None:
        assert self._thread is not None and self._stopped is not None and self._env is not None
        self._queue.put(_STOP)
        await self._stopped
        self._thread.join()
        with self._rw.write():
            self._env.close()
            self._env = None

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
        if not _is_receipt(receipt):
            raise ValueError(f"record id must be a receipt from new_receipt(), got {receipt!r}")
        scenario = _scenario_key(record.get("scenario"))
        to_link = None  # link=False: a record that must not continue its turn (a failed stream)
        previous = record.get("previous")
        if link and _is_receipt(previous):
            to_link = (str(previous).encode(), _pack({"next": receipt, "next_state": next_state or []}))
        linked: bool = await self._submit(self._apply_record, str(receipt).encode(), scenario, record, to_link)
        self._written(record["scenario"])
        return linked

    async def put_report(self, scenario: str, body: dict[str, Any], *, source: str = "client",
                         claims: list[str] | None = None) -> tuple[dict[str, Any], bool]:
        """Attach a report to records of `scenario`; returns (stored report, created). Durable on return.
        `source` says who reported: "client" (POST /reef/report) or "judge" (a recipe's judge in reefd).
        `claims` are keys (unique within the scenario) the report takes in the same transaction, such as a grid
        coordinate: ClaimTaken when another report holds one, and then nothing is stored."""
        scenario_key = _scenario_key(scenario)
        report_id = body.get("report_id") or "rpt_" + new_receipt()
        if not isinstance(report_id, str):
            raise ValueError(f"report_id must be a string, got {report_id!r}")
        score = body.get("score")
        report = {
            "report_id": report_id, "scenario": scenario, "references": list(body["references"]),
            "score": float(score) if isinstance(score, int | float) and not isinstance(score, bool) else score,
            "feedback": body.get("feedback"), "metadata": body.get("metadata"), "source": source,
            "created_at": time.time(),
        }
        packed = _pack(report)  # serialisation errors surface here, before the writer sees the op
        result: tuple[dict[str, Any], bool] = await self._submit(self._apply_report, scenario_key, report, packed,
                                                                 list(claims or []))
        self._written(scenario)
        if result[1]:
            for listener in list(self._report_listeners):
                try:
                    listener(scenario, result[0])
                except Exception:  # a listener's bug must not fail a report that is already durable
                    log.exception("a report listener failed")
        return result

    def subscribe_reports(self, listener: Callable[[str, dict[str, Any]], None]) -> Callable[[], None]:
        """Call `listener(scenario, report)` on the event loop after each new report is durable; returns the
        function that unsubscribes it. A listener must be quick."""
        self._report_listeners.append(listener)
        return lambda: self._report_listeners.remove(listener)

    def subscribe(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(scenario)` on the event loop after each record or report of that scenario is durable;
        returns the function that unsubscribes it. A listener must be quick and must not raise."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _written(self, scenario: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(scenario)
            except Exception:  # a listener's bug must not fail a write that is already durable
                log.exception("a record store listener failed")

    async def mark_consumed(self, scenario: str, receipts: list[str], by: str) -> None:
        """Record that a job's candidate (`by`) consumed these records: recipes never see them again. Durable."""
        await self._submit(self._apply_consumed, _scenario_key(scenario), list(receipts), by.encode())

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
        prefix = _scenario_key(scenario) + b"\0"
        keys: set[bytes] = set()
        with self._reading() as txn:
            for table in ("reported", "by_scenario"):
                with txn.cursor(db=self._dbs[table]) as cursor:
                    # the scenario's newest key: just before the first key past its prefix (or the last of all)
                    found = (cursor.set_range(prefix + b"\xff") and cursor.prev()) or cursor.last()
                    seen = 0
                    while found and seen < window:
                        key = cursor.key()
                        if not key.startswith(prefix):
                            break
                        seen += 1
                        keys.add(key)
                        found = cursor.prev()
            out = []
            for key in sorted(keys):  # receipt order: receipts sort by creation time
                if txn.get(key, db=self._dbs["consumed"]) is None:
                    record = self._load_record(txn, key[len(prefix):])
                    if record is not None and record.get("turn_kind") != "shadow":  # never served: never trained on
                        out.append(record)
        return out

    def _build_reported_index(self, env: lmdb.Environment) -> None:
        """Build the `reported` index (scenario NUL receipt, for records with a report that no candidate consumed)
        from the stored reports: once, for a store written before the index existed."""
        db, entries = self._dbs, 0
        try:
            with env.begin(write=True) as txn, txn.cursor(db=db["reports"]) as cursor:
                for _, value in cursor:
                    report = _unpack(value)
                    scenario = _scenario_key(report.get("scenario"))
                    for ref in report.get("references") or []:
                        key = scenario + b"\0" + str(ref).encode()
                        if txn.get(key, db=db["consumed"]) is None:
                            entries += txn.put(key, b"", db=db["reported"])
                txn.put(b"reported_index", b"1", db=db["meta"])
        except lmdb.MapFullError:  # built at a later start, once writes have grown the map
            log.warning("record store: no room to index reported records yet; older reported records beyond "
                        "the newest 20,000 are not eligible for training until it is built")
            return
        log.info("record store: indexed %d reported records", entries)

    async def _submit(self, apply: Callable[..., Any], *args: Any) -> Any:
        if self._loop is None or self._closing is not None:
            raise StoreClosed("record store is closed" if self._closing else "record store is not open")
        future = self._loop.create_future()
        self._queue.put((apply, args, future))
        return await future

    def _apply_record(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                      receipt: bytes, scenario: bytes, record: dict[str, Any],
                      link: tuple[bytes, bytes] | None) -> bool:
        if not txn.put(receipt, _pack(record), overwrite=False, db=self._dbs["records"]):
            raise ValueError(f"receipt {receipt.decode()} is already stored")
        txn.put(scenario + b"\0" + receipt, b"", db=self._dbs["by_scenario"])
        if isinstance(record.get("session"), str):
            txn.put(_session_prefix(scenario, record["session"]) + receipt, b"", db=self._dbs["by_session"])
        deltas.setdefault(scenario, [0, 0])[0] += 1
        linked = False
        if link is not None and txn.get(link[0], db=self._dbs["records"]) is not None:
            linked = bool(txn.put(link[0], link[1], overwrite=False, db=self._dbs["links"]))
        return linked

    def _apply_report(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                      scenario: bytes, report: dict[str, Any], packed: bytes,
                      claims: list[str]) -> tuple[dict[str, Any], bool]:
        db = self._dbs
        report_key = _report_key(scenario, report["report_id"])
        previous = self._find_report(txn, scenario, report["report_id"])
        if previous is not None:
            if _canonical(previous) != _canonical(report):
                raise ReportConflict(report["report_id"])
            return previous, False
        references = list(dict.fromkeys(report["references"]))
        for ref in references:
            if not _is_receipt(ref) or txn.get(scenario + b"\0" + ref.encode(), db=db["by_scenario"]) is None:
                raise UnknownReceipt(ref, report["scenario"])
        holder_id = report["report_id"].encode("utf-8", "surrogatepass")
        for claim in claims:
            holder = txn.get(scenario + b"\0" + claim.encode(), db=db["claims"])
            if holder is not None and holder != holder_id:
                raise ClaimTaken(claim, holder.decode("utf-8", "surrogatepass"))
        for claim in claims:
            txn.put(scenario + b"\0" + claim.encode(), holder_id, db=db["claims"])
        raw_seq = txn.get(b"report_seq", db=db["meta"])
        seq = _SEQ.unpack(raw_seq)[0] + 1 if raw_seq else 1
        txn.put(b"report_seq", _SEQ.pack(seq), db=db["meta"])
        txn.put(report_key, packed, db=db["reports"])
        for ref in references:  # receipt + sequence number: a receipt's reports come out oldest first
            txn.put(ref.encode() + _SEQ.pack(seq), report_key, db=db["report_index"])
            key = scenario + b"\0" + ref.encode()
            if txn.get(key, db=db["consumed"]) is None:
                txn.put(key, b"", db=db["reported"])
        deltas.setdefault(scenario, [0, 0])[1] += 1
        return report, True

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
        prefix = _scenario_key(scenario) + b"\0"
        picked: list[str] = []
        with self._reading() as txn:
            over = 0
            if max_records is not None:
                raw = txn.get(prefix[:-1], db=self._dbs["counts"])
                by_scenario = self._dbs["by_scenario"]
                kept = sum(txn.get(prefix + r.encode("utf-8", "surrogatepass"), db=by_scenario) is not None
                           for r in keep)
                over = (_COUNTS.unpack(raw)[0] if raw else 0) - kept - max_records
            with txn.cursor(db=self._dbs["by_scenario"]) as cursor:
                start = prefix + (after or "").encode()
                for key in cursor.iternext(values=False) if cursor.set_range(start) else ():
                    if not key.startswith(prefix):
                        break
                    receipt = key[len(prefix):].decode()
                    if key == start or receipt in keep:
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
        return int(await self._submit(self._apply_delete, _scenario_key(scenario), list(receipts)))

    def _apply_delete(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                      scenario: bytes, receipts: list[str]) -> int:
        db, prefix = self._dbs, scenario + b"\0"
        # First read everything the deletion needs, so that a value that cannot be read fails the op before any
        # write (the writer's rule for op errors); each report is read once however many of its records go.
        rows: list[tuple[bytes, Any]] = []  # (receipt, session)
        reports: dict[bytes, list[Any]] = {}  # report key -> its references
        for receipt in dict.fromkeys(receipts):
            key = receipt.encode()
            raw = txn.get(key, db=db["records"])
            if raw is None or txn.get(prefix + key, db=db["by_scenario"]) is None:
                continue
            rows.append((key, _unpack(raw).get("session")))
            with txn.cursor(db=db["report_index"]) as cursor:  # receipt + seq -> report key
                for index_key, report_key in cursor if cursor.set_range(key) else ():
                    if not index_key.startswith(key):
                        break
                    if report_key not in reports and (stored := txn.get(report_key, db=db["reports"])) is not None:
                        reports[report_key] = list(_unpack(stored).get("references") or [])
        for key, session in rows:
            txn.delete(prefix + key, db=db["by_scenario"])
            if isinstance(session, str):
                txn.delete(_session_prefix(scenario, session) + key, db=db["by_session"])
            for table in ("records", "links"):
                txn.delete(key, db=db[table])
            for table in ("consumed", "reported"):
                txn.delete(prefix + key, db=db[table])
            with txn.cursor(db=db["report_index"]) as cursor:
                found = cursor.set_range(key)
                while found and cursor.key().startswith(key):
                    found = cursor.delete()  # moves on to the next entry
        delta = deltas.setdefault(scenario, [0, 0])
        for report_key, refs in reports.items():  # a report goes with the last record it references
            if not any(txn.get(str(ref).encode(), db=db["records"]) for ref in refs):
                txn.delete(report_key, db=db["reports"])
                delta[1] -= 1
        delta[0] -= len(rows)
        return len(rows)

    # --- the writer thread ------------------------------------------------------------------

    def _writer_main(self) -> None:
        stop = False
        while not stop:
            ops: list[Op] = []
            item = self._queue.get()  # block for the first op, then take whatever else is queued
            while item is not _STOP:
                ops.append(item)
                if len(ops) >= self._max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            stop = item is _STOP
            if ops:
                try:
                    outcomes = self._commit_batch(ops)
                except BaseException as exc:  # never leave a caller waiting forever
                    outcomes = [(False, StorageError(f"record writer failed: {exc!r}")) for _ in ops]
                self._deliver([op[2] for op in ops], outcomes)
        if self._stopped is not None:
            self._deliver([self._stopped], [(True, None)])

    def _commit_batch(self, ops: list[Op]) -> list[Outcome]:
        """One transaction for the whole batch; grows the map and retries it when the map is full."""
        while True:
            try:
                return self._transact(ops)
            except lmdb.MapFullError:
                problem = self._grow()
            except (lmdb.Error, OSError) as exc:
                problem = f"record store write failed: {disk_says(self.path, exc)}"
            except Exception as exc:  # a bug in some op: commit the ops one by one to isolate it
                if len(ops) == 1:
                    return [(False, exc)]
                return [outcome for op in ops for outcome in self._commit_batch([op])]
            if problem:
                return [(False, StorageError(problem)) for _ in ops]

    def _transact(self, ops: list[Op]) -> list[Outcome]:
        assert self._env is not None
        outcomes: list[Outcome] = []
        deltas: dict[bytes, list[int]] = {}
        with self._env.begin(write=True) as txn:  # commits (with fsync) on exit, aborts on exception
            for apply, args, _ in ops:
                try:
                    outcomes.append((True, apply(txn, deltas, *args)))
                except _OP_ERRORS as exc:  # the op checked before writing anything: only it fails
                    outcomes.append((False, exc))
            counts = self._dbs["counts"]
            for scenario, (records, reports) in deltas.items():
                raw = txn.get(scenario, db=counts)
                old = _COUNTS.unpack(raw) if raw else (0, 0)
                txn.put(scenario, _COUNTS.pack(max(0, old[0] + records), max(0, old[1] + reports)), db=counts)
        self.stats["commits"] += 1
        self.stats["ops"] += len(ops)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(ops))
        return outcomes

    def _grow(self) -> str | None:
        """Double the map (up to max_grow) with no transaction open; a reason when it cannot."""
        assert self._env is not None
        size = self._env.info()["map_size"]
        target = min(size * 2, self._max_grow) // 4096 * 4096
        if target <= size:
            return f"record store is full: map is {size} bytes and max_grow is {self._max_grow}"
        try:
            with self._rw.write():
                self._env.set_mapsize(target)
        except (lmdb.Error, OSError) as exc:
            return f"record store is full: cannot grow the map to {target} bytes: {disk_says(self.path, exc)}"
        self.stats["grows"] += 1
        return None

    def _deliver(self, futures: list[asyncio.Future[Any]], outcomes: list[Outcome]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody left waiting
            self._loop.call_soon_threadsafe(_settle, futures, outcomes)

    # --- reads: synchronous, short read transactions ----------------------------------------

    @contextlib.contextmanager
    def _reading(self) -> Iterator[lmdb.Transaction[bytes]]:
        with self._rw.read():
            if self._env is None:
                raise StoreClosed("record store is not open")
            with self._env.begin() as txn:
                yield txn

    def get_record(self, receipt: str) -> dict[str, Any] | None:
        """The record with its "reports" (oldest first), or None."""
        if not _is_receipt(receipt):
            return None
        with self._reading() as txn:
            return self._load_record(txn, receipt.encode())

    def list_records(self, scenario: str, *, after: str | None = None, limit: int = 50,
                     session: str | None = None) -> list[dict[str, Any]]:
        """Records of one scenario (or of one session in it) in receipt order, strictly after
        `after`, each with its reports."""
        if session is None:
            prefix, db = _scenario_key(scenario) + b"\0", self._dbs["by_scenario"]
        else:
            prefix, db = _session_prefix(_scenario_key(scenario), session), self._dbs["by_session"]
        start = prefix + (after or "").encode("utf-8", "surrogatepass")
        if len(start) > 400:
            raise ValueError("`after` is too long to be a receipt")
        found: list[dict[str, Any]] = []
        with self._reading() as txn, txn.cursor(db=db) as cursor:
            for key in cursor.iternext(values=False) if cursor.set_range(start) else ():  # from `start` on
                if len(found) >= limit or not key.startswith(prefix):
                    break
                if key != start and (record := self._load_record(txn, key[len(prefix):])) is not None:
                    found.append(record)
        return found

    def export_page(self, scenario: str, after: str | None, *, limit: int = 100, reported_only: bool = False,
                    scan: int = 10_000) -> tuple[list[dict[str, Any]], str | None]:
        """Up to `limit` records of `scenario` (with their reports) strictly after `after`, in receipt order, looking
        at no more than `scan` keys; with `reported_only`, those with a report. Returns them and the receipt a next
        page goes on after, or None when the scenario has no more."""
        prefix = _scenario_key(scenario) + b"\0"
        start = prefix + (after or "").encode("utf-8", "surrogatepass")
        found: list[dict[str, Any]] = []
        seen = 0
        with self._reading() as txn, txn.cursor(db=self._dbs["by_scenario"]) as cursor:
            for key in cursor.iternext(values=False) if cursor.set_range(start) else ():
                if not key.startswith(prefix):
                    break
                if key == start:
                    continue
                receipt = key[len(prefix):]
                seen += 1
                if not reported_only or self._has_report(txn, receipt):
                    record = self._load_record(txn, receipt)
                    if record is not None:
                        found.append(record)
                if len(found) >= limit or seen >= scan:
                    return found, receipt.decode()
        return found, None

    def _has_report(self, txn: lmdb.Transaction[bytes], receipt: bytes) -> bool:
        with txn.cursor(db=self._dbs["report_index"]) as cursor:
            return cursor.set_range(receipt) and cursor.key().startswith(receipt)

    def recent(self, scenario: str, since: float, limit: int = 20_000) -> list[dict[str, Any]]:
        """The scenario's records created at or after `since` (at most `limit`), oldest first, without reports."""
        prefix = _scenario_key(scenario) + b"\0"
        out: list[dict[str, Any]] = []
        with self._reading() as txn, txn.cursor(db=self._dbs["by_scenario"]) as cursor:
            found = (cursor.set_range(prefix + b"\xff") and cursor.prev()) or cursor.last()
            while found and len(out) < limit:
                key = cursor.key()
                if not key.startswith(prefix):
                    break
                raw = txn.get(key[len(prefix):], db=self._dbs["records"])
                if raw is not None:
                    record = _unpack(raw)
                    if float(record.get("created_at") or 0) < since:
                        break
                    out.append(record)
                found = cursor.prev()
        return out[::-1]

    def claimed(self, scenario: str, prefix: str) -> dict[str, str]:
        """{claim: report_id} for the scenario's claims that start with `prefix` (one cursor range)."""
        start = _scenario_key(scenario) + b"\0"
        key_prefix = start + prefix.encode()
        out: dict[str, str] = {}
        with self._reading() as txn, txn.cursor(db=self._dbs["claims"]) as cursor:
            for key, value in cursor if cursor.set_range(key_prefix) else ():
                if not key.startswith(key_prefix):
                    break
                out[key[len(start):].decode()] = value.decode("utf-8", "surrogatepass")
        return out

    def get_report(self, scenario: str, report_id: str) -> dict[str, Any] | None:
        """The scenario's report of that id, or None."""
        if not isinstance(report_id, str) or not report_id:
            return None
        with self._reading() as txn:
            return self._find_report(txn, _scenario_key(scenario), report_id)

    def _find_report(self, txn: lmdb.Transaction[bytes], scenario: bytes, report_id: str) -> dict[str, Any] | None:
        raw = txn.get(_report_key(scenario, report_id), db=self._dbs["reports"])
        if raw is not None:
            return _unpack(raw)
        raw = txn.get(_legacy_report_key(report_id), db=self._dbs["reports"])
        legacy = None if raw is None else _unpack(raw)
        return legacy if legacy is not None and str(legacy.get("scenario")).encode() == scenario else None

    def counts(self) -> dict[str, dict[str, int]]:
        """{scenario: {"records": n, "reports": m}}, kept by the write transactions (no scan of records)."""
        with self._reading() as txn:
            return {key.decode(): dict(zip(("records", "reports"), _COUNTS.unpack(raw), strict=True))
                    for key, raw in txn.cursor(db=self._dbs["counts"])}

    def _load_record(self, txn: lmdb.Transaction[bytes], receipt: bytes) -> dict[str, Any] | None:
        raw = txn.get(receipt, db=self._dbs["records"])
        if raw is None:
            return None
        record: dict[str, Any] = _unpack(raw)
        link = txn.get(receipt, db=self._dbs["links"])
        if link is not None:
            record.update(_unpack(link))
        reports = []
        with txn.cursor(db=self._dbs["report_index"]) as cursor:
            for key, report_key in cursor if cursor.set_range(receipt) else ():  # receipt + seq -> report
                if not key.startswith(receipt):
                    break
                if (stored := txn.get(report_key, db=self._dbs["reports"])) is not None:
                    reports.append(_unpack(stored))
        record["reports"] = reports
        return record


def _settle(futures: list[asyncio.Future[Any]], outcomes: list[Outcome]) -> None:
    """Runs on the event loop: wake every caller of a committed (or failed) batch."""
    for future, (ok, value) in zip(futures, outcomes, strict=True):
        if future.done():  # the caller was cancelled; its write stands
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
