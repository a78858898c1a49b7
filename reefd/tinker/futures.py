"""The Tinker API's futures: a request that trains or samples is answered at once with a request id, and its result
is fetched with `retrieve_future`, which waits up to WAIT_S for it and otherwise says "try again". A result is kept
for KEEP_S after it is ready, so asking twice gets it twice; a future nobody asks for goes after KEEP_S too, and
at most MAX futures are kept (the oldest finished go first; a submission past MAX while every kept one is still
running is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    """A request that failed: `category` is Tinker's RequestErrorCategory ("user": the request's fault)."""

    message: str
    category: str


@dataclass(frozen=True)
class Result:
    """A finished request's answer: protobuf bytes (`proto`) or a JSON object."""

    proto: bytes | None = None
    json: dict[str, object] | None = None


Outcome = Result | Failure


class TooMany(Exception):
    """A bound is reached: futures here, sessions or models in service.py (the route answers 429, not to be
    retried)."""


@dataclass
class _Entry:
    task: asyncio.Task[Outcome]
    done_at: float | None = None


class Futures:
    WAIT_S = 20.0  # under the SDK's 45 s read timeout of a retrieve
    KEEP_S = 3600.0
    MAX = 4096

    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def submit(self, work: Awaitable[Outcome], kind: str) -> str:
        """Start `work` (it returns an Outcome, never raises) and name it; TooMany past MAX."""
        self._expire()
        if len(self._entries) >= self.MAX:
            finished = [k for k, e in self._entries.items() if e.task.done()]
            if not finished:
                if asyncio.iscoroutine(work):
                    work.close()
                raise TooMany(f"{self.MAX} requests are still running; retrieve their results first")
            self._entries.pop(finished[0])
        request_id = f"{kind}-{secrets.token_hex(8)}"
        task: asyncio.Task[Outcome] = asyncio.ensure_future(work)
        entry = _Entry(task)

        def ended(_: object) -> None:
            entry.done_at = time.monotonic()

        task.add_done_callback(ended)
        self._entries[request_id] = entry
        return request_id

    async def retrieve(self, request_id: str, wait_s: float | None = None) -> Outcome | None:
        """The request's outcome, or None if it is not ready within `wait_s` (try again). KeyError: unknown or
        expired."""
        entry = self._entries[request_id]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(entry.task), self.WAIT_S if wait_s is None else wait_s)
        return entry.task.result() if entry.task.done() else None

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if e.done_at is not None and now - e.done_at > self.KEEP_S]:
            self._entries.pop(key)

    async def close(self) -> None:
        tasks = [e.task for e in self._entries.values() if not e.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._entries.clear()
