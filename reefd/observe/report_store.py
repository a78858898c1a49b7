"""Reports in the record store: one per report_id in its scenario, scoring records of it, taking claims (keys unique
in the scenario) and indexing its records. Knows the store's tables; nothing of HTTP, judges or recipes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import lmdb

from reefd.observe.groupcommit import GroupCommit, Refused, practice_key, scenario_key, user_key
from reefd.observe.receipts import is_receipt, new_receipt
from reefd.observe.recordcodec import pack, unpack

log = logging.getLogger("reefd.observe.records")

_SEQ = struct.Struct(">Q")
MAX_SCORE = 1e9  # a score's range is [-MAX_SCORE, MAX_SCORE]: a trial's means stay numbers a person can read
MAX_REPORT_FIELD_BYTES = 64 * 1024  # a report's metadata, and its feedback, as JSON


class UnknownReceipt(Refused):
    """A report references a receipt that does not exist or belongs to another scenario."""

    def __init__(self, receipt: str, scenario: str = "") -> None:
        super().__init__(f"unknown receipt {receipt!r} for this scenario")
        self.receipt, self.scenario = receipt, scenario


class ReportConflict(Refused):
    """A report_id is already stored with a different body."""

    def __init__(self, report_id: str) -> None:
        super().__init__(f"report {report_id!r} already exists with a different body")
        self.report_id = report_id


class ClaimTaken(Refused):
    """A report claims a key (a grid coordinate) that another report already holds: the first one keeps it."""

    def __init__(self, claim: str, holder: str) -> None:
        super().__init__(f"{claim} is already reported by {holder!r}")
        self.claim, self.holder = claim, holder


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


class Reports(GroupCommit):
    """The report side of the record store (RecordStore)."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        super().__init__(path, **options)
        self._report_listeners: list[Callable[[str, dict[str, Any]], None]] = []

    async def put_report(self, scenario: str, body: dict[str, Any], *, source: str = "client",
                         claims: list[str] | None = None, user: str | None = None) -> tuple[dict[str, Any], bool]:
        """Attach a report to records of `scenario`; returns (stored report, created). Durable on return.
        `source` says who reported: "client" (POST /reef/report) or "judge" (a recipe's judge in reefd).
        `claims` are keys (unique within the scenario) the report takes in the same transaction, such as a grid
        coordinate: ClaimTaken when another report holds one, and then nothing is stored. `user`: the user whose
        records it references (it counts among that user's reports)."""
        key = scenario_key(scenario)
        report_id = body.get("report_id") or "rpt_" + new_receipt()
        if not isinstance(report_id, str):
            raise ValueError(f"report_id must be a string, got {report_id!r}")
        score = body.get("score")
        report = {
            "report_id": report_id, "scenario": scenario, "references": list(body["references"]),
            "score": float(score) if isinstance(score, int | float) and not isinstance(score, bool) else score,
            "feedback": body.get("feedback"), "metadata": body.get("metadata"), "source": source,
            "created_at": time.time(), **({"user": user} if user is not None else {})}
        packed = pack(report)  # serialisation errors surface here, before the writer sees the op
        result: tuple[dict[str, Any], bool] = await self._submit(self._apply_report, key, report, packed,
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

    def _apply_report(self, txn: lmdb.Transaction[bytes], deltas: dict[bytes, list[int]],
                      scenario: bytes, report: dict[str, Any], packed: bytes,
                      claims: list[str]) -> tuple[dict[str, Any], bool]:
        db = self._dbs
        previous = self._find_report(txn, scenario, report["report_id"])
        if previous is not None:
            if _canonical(previous) != _canonical(report):
                raise ReportConflict(report["report_id"])
            return previous, False
        references = list(dict.fromkeys(report["references"]))
        for ref in references:
            if not is_receipt(ref) or txn.get(scenario + b"\0" + ref.encode(), db=db["by_scenario"]) is None:
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
        report_key = _report_key(scenario, report["report_id"])
        txn.put(report_key, packed, db=db["reports"])
        for ref in references:  # receipt + sequence number: a receipt's reports come out oldest first
            txn.put(ref.encode() + _SEQ.pack(seq), report_key, db=db["report_index"])
            key = scenario + b"\0" + ref.encode()
            if txn.get(key, db=db["consumed"]) is None:
                txn.put(key, b"", db=db["reported"])
        deltas.setdefault(scenario, [0, 0])[1] += 1
        if report.get("source") == "verifier":  # practice's verdicts, counted apart
            deltas.setdefault(practice_key(scenario), [0, 0])[1] += 1
        if isinstance(user := report.get("user"), str):  # on a user's records (reefd/api/reports.py says whose)
            deltas.setdefault(user_key(scenario, user), [0, 0])[1] += 1
        return report, True

    def get_report(self, scenario: str, report_id: str) -> dict[str, Any] | None:
        """The scenario's report of that id, or None."""
        if not isinstance(report_id, str) or not report_id:
            return None
        with self._reading() as txn:
            return self._find_report(txn, scenario_key(scenario), report_id)

    def _find_report(self, txn: lmdb.Transaction[bytes], scenario: bytes, report_id: str) -> dict[str, Any] | None:
        raw = txn.get(_report_key(scenario, report_id), db=self._dbs["reports"])
        if raw is not None:
            return unpack(raw)
        raw = txn.get(_legacy_report_key(report_id), db=self._dbs["reports"])
        legacy = None if raw is None else unpack(raw)
        return legacy if legacy is not None and str(legacy.get("scenario")).encode() == scenario else None

    def claimed(self, scenario: str, prefix: str) -> dict[str, str]:
        """{claim: report_id} for the scenario's claims that start with `prefix` (one cursor range)."""
        start = scenario_key(scenario) + b"\0"
        key_prefix = start + prefix.encode()
        out: dict[str, str] = {}
        with self._reading() as txn, txn.cursor(db=self._dbs["claims"]) as cursor:
            for key, value in cursor if cursor.set_range(key_prefix) else ():
                if not key.startswith(key_prefix):
                    break
                out[key[len(start):].decode()] = value.decode("utf-8", "surrogatepass")
        return out

    async def _upgrade(self, env: lmdb.Environment) -> None:
        with env.begin() as txn:
            if txn.get(b"reported_index", db=self._dbs["meta"]) is not None:
                return
        await asyncio.to_thread(self._build_reported_index, env)  # a store from before the index: built once

    def _build_reported_index(self, env: lmdb.Environment) -> None:
        """Build the `reported` index (scenario NUL receipt, for records with a report that no candidate consumed)
        from the stored reports: once, for a store written before the index existed."""
        db, entries = self._dbs, 0
        try:
            with env.begin(write=True) as txn, txn.cursor(db=db["reports"]) as cursor:
                for _, value in cursor:
                    report = unpack(value)
                    scenario = scenario_key(report.get("scenario"))
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
