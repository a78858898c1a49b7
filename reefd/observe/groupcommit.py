"""One LMDB env written by one group-commit thread: queued ops share a durable transaction, the map grows when full,
and per-scenario counts of records and reports change in it. Knows nothing of what a record or a report is: an op
is a function of the write transaction (records.py, report_store.py)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import queue
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

from reefd.ops.files import fsync_path

log = logging.getLogger("reefd.observe.records")

LOW_DISK = 64 << 20  # free bytes under which a failed write is taken for a full disk
COUNTS = struct.Struct(">QQ")  # records, reports
PRACTICE = b"\0practice"  # a counts key: the scenario's name, then this, counts its practice records and reports


USER = b"\0user\0"  # a counts key: the scenario's name, this, then a user's name: that user's records and reports


def practice_key(scenario: bytes) -> bytes:
    """The counts key of a scenario's practice records and verdicts (a scenario name never holds a NUL)."""
    return scenario + PRACTICE


def user_key(scenario: bytes, user: str) -> bytes:
    """The counts key (and `by_user` prefix) of one user's records and reports (a user's name holds no NUL)."""
    return scenario + USER + user.encode()
_STOP = object()
Outcome = tuple[bool, Any]  # (True, result) or (False, exception)
Op = tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]


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


class Refused(Exception):
    """An op's refusal, raised before it wrote anything: only that op fails, its batch commits."""


_OP_ERRORS = (Refused, ValueError, TypeError, RecursionError)


def scenario_key(scenario: object) -> bytes:
    key = scenario.encode() if isinstance(scenario, str) else b""
    if not key or b"\0" in key or len(key) > 256:
        raise ValueError(f"scenario must be a non-empty name without NUL, at most 256 bytes: {scenario!r}")
    return key


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


class GroupCommit:
    """The env, its tables (TABLES), the writer thread and the read lock. Writes are group-committed by one
    thread; reads are inline."""

    TABLES: tuple[str, ...] = ("counts",)

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = 1 << 30, max_batch: int = 1024,
                 max_grow: int = 1 << 40) -> None:
        self.path = os.fspath(path)
        self._map_size, self._max_batch, self._max_grow = map_size, max_batch, max_grow
        self._env: lmdb.Environment | None = None
        self._dbs: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._rw = _RWLock()
        self._batch_lock = threading.Lock()  # held by the writer for a batch, and by `compact`
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self.stats = {"commits": 0, "ops": 0, "grows": 0, "largest_batch": 0}
        self._listeners: list[Callable[[str], None]] = []

    # --- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the folder, open the env and its tables, start the writer thread."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.open() called twice")
        os.makedirs(self.path, exist_ok=True)
        env = self._open_env(self._map_size)
        await self._upgrade(env)
        self._env, self._loop = env, asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._thread = threading.Thread(target=self._writer_main, name="reef-records-writer", daemon=True)
        self._thread.start()

    def _open_env(self, map_size: int) -> lmdb.Environment:
        env = lmdb.open(self.path, map_size=map_size, subdir=True, max_dbs=16, sync=True, metasync=True,
                        writemap=False)
        with env.begin(write=True) as txn:
            self._dbs = {name: env.open_db(name.encode(), txn=txn) for name in self.TABLES}
        return env

    def compact(self) -> int:
        """Rewrite the env's file without its free pages, where deleted values stay until LMDB reuses them, so
        that nothing deleted can be read from the file any more (a user's deletion). Reads and writes wait
        meanwhile; a crash leaves the old file or the new one, each whole. Blocking; returns the bytes the file
        shrank by."""
        with self._batch_lock, self._rw.write():
            env = self._env
            if env is None:
                raise StoreClosed("record store is not open")
            data, tmp = os.path.join(self.path, "data.mdb"), self.path + ".compact"
            before, map_size = os.path.getsize(data), env.info()["map_size"]
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            env.copy(tmp, compact=True)
            fsync_path(Path(tmp) / "data.mdb")
            env.close()
            self._env = None
            os.replace(os.path.join(tmp, "data.mdb"), data)
            fsync_path(Path(self.path))
            shutil.rmtree(tmp, ignore_errors=True)
            self._env = self._open_env(map_size)
            return before - os.path.getsize(data)

    async def _upgrade(self, env: lmdb.Environment) -> None:
        """Bring what an older reefd wrote up to date, before the writer starts."""

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

    async def _submit(self, apply: Callable[..., Any], *args: Any) -> Any:
        """Run `apply(txn, deltas, *args)` in the next batch; its result once that batch is durable. `deltas` maps a
        scenario key to its [records, reports] changes."""
        if self._loop is None or self._closing is not None:
            raise StoreClosed("record store is closed" if self._closing else "record store is not open")
        future = self._loop.create_future()
        self._queue.put((apply, args, future))
        return await future

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
        with self._batch_lock:
            return self._commit_locked(ops)

    def _commit_locked(self, ops: list[Op]) -> list[Outcome]:
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
                return [outcome for op in ops for outcome in self._commit_locked([op])]
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
                old = COUNTS.unpack(raw) if raw else (0, 0)
                txn.put(scenario, COUNTS.pack(max(0, old[0] + records), max(0, old[1] + reports)), db=counts)
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

    def counts(self) -> dict[str, dict[str, int]]:
        """{scenario: {"records": n, "reports": m, "practice_records": p, "practice_reports": q}}, kept by the write
        transactions (no scan of records): every record and report, and of them those of practice."""
        out: dict[str, dict[str, int]] = {}
        with self._reading() as txn:
            for key, raw in txn.cursor(db=self._dbs["counts"]):
                if USER in key:
                    continue  # a user's counts: user_counts
                name, practice = (key[:-len(PRACTICE)], "practice_") if key.endswith(PRACTICE) else (key, "")
                mine = out.setdefault(name.decode(), {"records": 0, "reports": 0, "practice_records": 0,
                                                      "practice_reports": 0})
                mine[f"{practice}records"], mine[f"{practice}reports"] = COUNTS.unpack(raw)
        return out

    def user_counts(self, scenario: str) -> dict[str, dict[str, int]]:
        """{user: {"records": n, "reports": m}} of a scenario's users, kept by the write transactions."""
        prefix = scenario_key(scenario) + USER
        out: dict[str, dict[str, int]] = {}
        with self._reading() as txn, txn.cursor(db=self._dbs["counts"]) as cursor:
            for key, raw in cursor if cursor.set_range(prefix) else ():
                if not key.startswith(prefix):
                    break
                records, reports = COUNTS.unpack(raw)
                out[key[len(prefix):].decode()] = {"records": records, "reports": reports}
        return out


def _settle(futures: list[asyncio.Future[Any]], outcomes: list[Outcome]) -> None:
    """Runs on the event loop: wake every caller of a committed (or failed) batch."""
    for future, (ok, value) in zip(futures, outcomes, strict=True):
        if future.done():  # the caller was cancelled; its write stands
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
