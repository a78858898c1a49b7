"""Admission control: a bounded line in front of each engine.

An engine generates for a batch of requests at once; more requests than that wait. Without a bound they wait
without end (100 concurrent streams on one engine waited 81 s for a first byte at the median), and a client
cannot tell a slow answer from a stuck one. Here at most `limit` requests hold the engine, at most `max_queue`
more wait their turn in arrival order, each for at most `max_wait_s`. Beyond the line a request is refused at
once (429); one that waited too long is refused then (503); both carry Retry-After, so the providers' SDKs retry
by themselves. Background work (practice) takes a turn only from the idle half of the engine and never while a
request waits, so requests always go first and a burst of them pauses it; background work that preempts takes
one only from an engine serving no request, and is told to stop by the next request that asks. Knows nothing
about HTTP or engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

LEFT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
BACKGROUND_POLL_S = 0.1  # how often background work looks for an idle turn


class Overloaded(Exception):
    """The engine's line is full (429) or the wait for a turn ran out (503). Retry after `retry_after` s."""

    def __init__(self, message: str, status: int, retry_after: int):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Left(Exception):
    """The client went away while its request waited in the line; its place went to the next one."""


class Admission:
    """Turns at one engine: `limit` at once, `max_queue` waiting, `max_wait_s` the longest wait."""

    def __init__(self, name: str, limit: int, max_queue: int, max_wait_s: float):
        self.name = name
        self.limit = limit
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self.refused: Counter[str] = Counter()  # "queue_full" (429) and "queue_timeout" (503)
        self.background = 0  # of `running`: background work's turns
        self.preempted = 0  # background turns told to stop by a request
        self._yielding: set[asyncio.Event] = set()  # preemptible background turns: set when a request asks

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def resize(self, limit: int, max_queue: int, max_wait_s: float) -> None:
        """New bounds (a reload changed the model's settings); waiting requests keep their place."""
        self.limit, self.max_queue, self.max_wait_s = limit, max_queue, max_wait_s
        while self._waiting and self.running < self.limit:
            self._grant()

    async def enter(self, left: Callable[[], bool] | None = None) -> None:
        """Hold one of the engine's turns (Overloaded when there is none to wait for) until `leave`. `left()` says
        whether the client went away: checked while waiting, it gives the place up (Left). Preemptible background
        turns are told to stop at once."""
        for stop in self._yielding:
            self.preempted += not stop.is_set()
            stop.set()
        if self.running < self.limit and not self._waiting:
            self.running += 1
            return
        if len(self._waiting) >= self.max_queue:
            self.refused["queue_full"] += 1
            raise Overloaded(f"{self.name} is at capacity: {self.running} requests generating and "
                             f"{len(self._waiting)} waiting (model.max_queue); retry shortly", 429, retry_after=1)
        clock = asyncio.get_running_loop()
        turn: asyncio.Future[None] = clock.create_future()
        self._waiting.append(turn)
        deadline = clock.time() + self.max_wait_s
        try:
            while not turn.done() and (wait := deadline - clock.time()) > 0:
                await asyncio.wait({turn}, timeout=wait if left is None else min(wait, LEFT_POLL_S))
                if not turn.done() and left is not None and left():
                    self._forfeit(turn)
                    raise Left(f"the client left while waiting for a turn at {self.name}")
        except asyncio.CancelledError:  # the handler was cancelled while waiting
            self._forfeit(turn)
            raise
        if not turn.done():
            self._forfeit(turn)
            self.refused["queue_timeout"] += 1
            raise Overloaded(f"{self.name} is busy: no turn came within {self.max_wait_s:g} s "
                             f"(model.max_queue_wait_s); retry shortly", 503, retry_after=2)

    async def enter_background(self, preempt: bool = False) -> asyncio.Event:
        """Hold a turn for background work until `leave(background=True, stop=...)`: once nobody waits and fewer
        than half the turns (at least one) are taken; with `preempt`, once no request holds one, up to every turn.
        Until then it waits, however long. The event returned is set when a request asks for a turn (with
        `preempt`): the holder should stop and leave, and the request takes its turn."""
        share = self.limit if preempt else max(1, self.limit // 2)
        while self._waiting or self.running >= share or (preempt and self.running > self.background):
            await asyncio.sleep(BACKGROUND_POLL_S)
        self.running += 1
        self.background += 1
        stop = asyncio.Event()
        if preempt:
            self._yielding.add(stop)
        return stop

    def _forfeit(self, turn: asyncio.Future[None]) -> None:
        """Give up a place in the line; a turn granted meanwhile goes to the next in line."""
        if turn.done() and not turn.cancelled():
            self.leave()
            return
        turn.cancel()
        with contextlib.suppress(ValueError):
            self._waiting.remove(turn)

    def leave(self, background: bool = False, stop: asyncio.Event | None = None) -> None:
        self.running -= 1
        self.background -= background
        if stop is not None:
            self._yielding.discard(stop)
        while self._waiting and self.running < self.limit:
            self._grant()

    def _grant(self) -> None:
        turn = self._waiting.popleft()
        if not turn.done():
            self.running += 1
            turn.set_result(None)

    def describe(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": len(self._waiting), "background": self.background,
                "preempted": self.preempted, "limit": self.limit,
                "max_queue": self.max_queue, "max_queue_wait_s": self.max_wait_s, "refused": dict(self.refused)}
