"""`GET /reef/scenarios/{name}/export`: a scenario's records, each with its reports, as JSON lines (`reefctl export`).

Streams in receipt order, a page at a time read and serialised in a thread, so memory stays bounded and the event
loop free however many records there are. Knows the query's shape (`since`, `reported_only`); the records' own
shape is the store's, as `GET /reef/records/{receipt}` answers it.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime
import logging
import re
import time

import orjson
from aiohttp import web

from reefd.api import access
from reefd.api.admin import practice_filter
from reefd.api.errors import ApiError, shown
from reefd.commit.chain import ReleaseChain, UnknownRelease, WrongScenario
from reefd.loop import CHAIN, RECORDS
from reefd.observe.receipts import is_receipt, receipt_floor
from reefd.observe.records import RecordStore

log = logging.getLogger("reefd.api")

PAGE = 100  # records per page: read, serialised and written before the next is read
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RELEASE = re.compile(r"r(0|[1-9][0-9]{0,8})-[0-9a-f]{7}")
SINCE_HELP = ("a receipt (the records after it), a release id (those since it was published), a duration "
              "(90s, 30m, 24h, 7d: those that recent) or an RFC 3339 time (2025-01-31T00:00:00Z)")


def _after_time(seconds: float) -> str:
    return receipt_floor(int(seconds * 1000))


def since_cursor(since: str, scenario: str, chain: ReleaseChain) -> str | None:
    """The receipt the export starts after (blocking: a release id is looked up in the chain)."""
    if not since:
        return None
    if is_receipt(since):
        return since
    if (m := _DURATION.fullmatch(since)) is not None:
        return _after_time(time.time() - float(m.group(1)) * _UNIT_S[m.group(2)])
    if _RELEASE.fullmatch(since):
        try:
            release = chain.target(scenario, since, include_rejected=True)
        except (UnknownRelease, WrongScenario):  # another scenario's release: as if it did not exist
            raise ApiError(404, f"since: no release {shown(since)} in scenario {shown(scenario)}", param="since",
                           code="release_not_found") from None
        return _after_time(calendar.timegm(time.strptime(release.created_at, "%Y-%m-%dT%H:%M:%SZ")))
    try:
        when = datetime.datetime.fromisoformat(since)
    except ValueError:
        raise ApiError(400, f"since: {shown(since)} is not {SINCE_HELP}", param="since") from None
    if when.tzinfo is None:
        raise ApiError(400, f"since: {shown(since)} has no time zone (add Z or +00:00)", param="since")
    return _after_time(when.timestamp())


def _flag(raw: str | None, name: str) -> bool:
    if raw is None or raw.lower() in ("", "0", "false", "no"):
        return False
    if raw.lower() in ("1", "true", "yes"):
        return True
    raise ApiError(400, f"{name}: {shown(raw)} is not true or false", param=name)


def _page(store: RecordStore, scenario: str, after: str | None, reported_only: bool,
          practice: str, user: str | None) -> tuple[bytes, str | None]:
    records, cursor = store.export_page(scenario, after, limit=PAGE, reported_only=reported_only, practice=practice,
                                        user=user)
    return b"".join(orjson.dumps(r) + b"\n" for r in records), cursor


async def export(request: web.Request) -> web.StreamResponse:
    scenario = access.scenario(request, request.match_info["name"], param="name")
    reported_only = _flag(request.query.get("reported_only"), "reported_only")
    practice, user = practice_filter(request), access.reader(request)
    since = request.query.get("since", "")
    if len(since) > 64:
        raise ApiError(400, f"since: expected {SINCE_HELP}", param="since")
    after = await asyncio.to_thread(since_cursor, since, scenario.name, request.app[CHAIN])
    store = request.app[RECORDS]
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson; charset=utf-8"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        while True:
            chunk, after = await asyncio.to_thread(_page, store, scenario.name, after, reported_only, practice,
                                                   user)
            if chunk:
                await response.write(chunk)
            if after is None:
                break
    except (ConnectionError, asyncio.CancelledError):  # the client went away: nobody to tell
        raise
    except Exception:
        log.exception("%s: an export stopped half-way", scenario.name)
        if request.transport is not None:  # cut: the client must not take what it got for the whole export
            request.transport.close()
        raise
    await response.write_eof()
    return response
