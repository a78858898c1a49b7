"""The line in front of an engine: turns in arrival order, 429 past the line, 503 past the wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from reefd.serve.admission import Admission, Left, Overloaded


@contextlib.asynccontextmanager
async def turn(line: Admission, left: Callable[[], bool] | None = None) -> AsyncIterator[None]:
    """A turn held for the body of the block (what reefd.serve.scenarios.Serving does around a request)."""
    await line.enter(left)
    try:
        yield
    finally:
        line.leave()


async def hold(line: Admission, order: list[str], name: str, release: asyncio.Event) -> None:
    async with turn(line):
        order.append(name)
        await release.wait()


def test_turns_come_in_arrival_order_and_past_the_line_is_429() -> None:
    async def main() -> None:
        line = Admission("m", limit=2, max_queue=2, max_wait_s=30)
        order: list[str] = []
        gates = {n: asyncio.Event() for n in "abcd"}
        tasks = {n: asyncio.create_task(hold(line, order, n, gates[n])) for n in "abcd"}
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and (line.running, line.waiting) == (2, 2)
        with pytest.raises(Overloaded) as refused:
            async with turn(line):
                pass
        assert refused.value.status == 429 and refused.value.retry_after >= 1
        assert "max_queue" in str(refused.value)
        gates["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"]  # the first in line takes the freed turn
        gates["a"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c", "d"] and (line.running, line.waiting) == (2, 0)
        for n in "cd":
            gates[n].set()
        await asyncio.gather(*tasks.values())
        assert (line.running, line.waiting) == (0, 0)
        assert line.describe()["refused"] == {"queue_full": 1}

    asyncio.run(main())


def test_a_wait_past_max_queue_wait_is_503_and_frees_its_place() -> None:
    async def main() -> None:
        line = Admission("m", limit=1, max_queue=1, max_wait_s=0.05)
        busy = asyncio.Event()
        first = asyncio.create_task(hold(line, [], "a", busy))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as late:
            async with turn(line):
                pass
        assert late.value.status == 503 and "max_queue_wait_s" in str(late.value)
        assert line.waiting == 0  # its place is free again: the next one may wait
        waiter = asyncio.create_task(hold(line, (order := []), "b", asyncio.Event()))
        await asyncio.sleep(0.01)
        assert line.waiting == 1
        busy.set()
        await first
        await asyncio.sleep(0.01)
        assert order == ["b"]
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert (line.running, line.waiting) == (0, 0)

    asyncio.run(main())


def test_a_client_that_leaves_the_line_gives_up_its_place_or_its_turn() -> None:
    async def main() -> None:
        line = Admission("m", limit=1, max_queue=4, max_wait_s=30)
        busy = asyncio.Event()
        first = asyncio.create_task(hold(line, [], "a", busy))
        await asyncio.sleep(0.01)
        order: list[str] = []
        gone = asyncio.create_task(hold(line, order, "b", asyncio.Event()))
        later = asyncio.create_task(hold(line, order, "c", (done := asyncio.Event())))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert line.waiting == 1
        busy.set()
        await first
        await asyncio.sleep(0.01)
        assert order == ["c"]
        done.set()
        await later
        # a turn granted in the same instant the client left goes to the next in line, never lost
        await line.enter()  # x holds the only turn
        leaving = asyncio.create_task(hold(line, order, "y", asyncio.Event()))
        after = asyncio.create_task(hold(line, order, "z", (end := asyncio.Event())))
        await asyncio.sleep(0.01)
        line.leave()  # x is done: its turn goes to y at once ...
        leaving.cancel()  # ... and y leaves before it could use it
        await asyncio.sleep(0.01)
        assert order[-1] == "z" and line.running == 1
        end.set()
        await after
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        assert (line.running, line.waiting) == (0, 0)

    asyncio.run(main())


def test_a_reload_that_raises_the_limit_lets_waiting_requests_in() -> None:
    async def main() -> None:
        line = Admission("m", limit=1, max_queue=4, max_wait_s=30)
        order: list[str] = []
        gates = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(hold(line, order, str(i), g)) for i, g in enumerate(gates)]
        await asyncio.sleep(0.01)
        assert order == ["0"]
        line.resize(3, 4, 30)
        await asyncio.sleep(0.01)
        assert order == ["0", "1", "2"] and line.waiting == 0
        for g in gates:
            g.set()
        await asyncio.gather(*tasks)
        assert line.running == 0

    asyncio.run(main())


def test_a_client_that_leaves_while_waiting_gives_its_place_to_the_next() -> None:
    async def main() -> None:
        line = Admission("m", limit=1, max_queue=2, max_wait_s=30)
        busy, gone = asyncio.Event(), False
        order: list[str] = []
        first = asyncio.create_task(hold(line, order, "a", busy))
        await asyncio.sleep(0.01)

        async def leaver() -> None:
            async with turn(line, left=lambda: gone):
                order.append("leaver")

        waiting = asyncio.create_task(leaver())
        later = asyncio.create_task(hold(line, order, "c", asyncio.Event()))
        await asyncio.sleep(0.01)
        assert line.waiting == 2
        gone = True
        with pytest.raises(Left):
            await asyncio.wait_for(waiting, timeout=5)
        assert line.waiting == 1 and line.describe()["refused"] == {}  # not a refusal: nobody was there to refuse
        busy.set()
        await asyncio.sleep(0.01)
        assert order == ["a", "c"] and line.running == 1  # the next in line took the turn
        later.cancel()
        await asyncio.gather(first, later, return_exceptions=True)
        assert (line.running, line.waiting) == (0, 0)

    asyncio.run(main())


def test_background_work_takes_only_idle_turns_and_requests_go_first() -> None:
    """Practice's turns: only while nobody waits and under half the turns are taken; a burst of requests pauses
    it (it waits, however long), and a request never waits behind a background turn that has not started."""

    async def main() -> None:
        line = Admission("engine", limit=4, max_queue=10, max_wait_s=5)
        await line.enter_background()  # idle: at once
        assert (line.running, line.background) == (1, 1)
        users = [asyncio.create_task(line.enter()) for _ in range(4)]  # a burst: 3 get turns, 1 waits
        await asyncio.sleep(0)
        assert line.running == 4 and line.waiting == 1
        second = asyncio.create_task(line.enter_background())
        await asyncio.sleep(0.3)
        assert not second.done()  # paused while the burst lasts
        line.leave(background=True)  # the first practice answer ends: the waiting request gets its turn
        await asyncio.gather(*users)
        assert line.waiting == 0 and line.background == 0 and not second.done()
        for _ in range(2):
            line.leave()
        await asyncio.sleep(0.3)
        assert not second.done()  # 2 of 4 turns taken: not idle enough
        line.leave()
        await asyncio.wait_for(second, 1)  # it starts once fewer than half are taken
        assert (line.running, line.background) == (2, 1)
        assert line.describe()["background"] == 1

    asyncio.run(main())


def test_preempting_background_work_takes_only_an_idle_engine_and_stops_for_a_request() -> None:
    """Practice with `preempt`: it starts only while no request holds a turn, and the next request to ask tells
    every preemptible holder to stop (at once, whether or not a turn is free), counted once each."""

    async def main() -> None:
        line = Admission("engine", limit=4, max_queue=10, max_wait_s=5)
        first = await line.enter_background(preempt=True)
        plain = await line.enter_background()  # one that does not preempt is never told to stop
        assert (line.running, line.background) == (2, 2) and not first.is_set()
        more = [await asyncio.wait_for(line.enter_background(preempt=True), 1) for _ in range(2)]
        assert line.running == 4  # on an idle engine, preempting work may take every turn
        for stop in more:
            line.leave(background=True, stop=stop)
        await line.enter()  # a request: a turn is free, and the preemptible practice answer is told to stop
        assert first.is_set() and not plain.is_set() and line.describe()["preempted"] == 1
        await line.enter()
        assert line.describe()["preempted"] == 1  # told once
        line.leave(background=True, stop=first)
        line.leave(background=True, stop=plain)
        later = asyncio.create_task(line.enter_background(preempt=True))
        await asyncio.sleep(0.3)
        assert not later.done()  # two requests still hold turns (under half would do without preempt)
        line.leave()
        await asyncio.sleep(0.3)
        assert not later.done()  # one still does
        line.leave()
        stop = await asyncio.wait_for(later, 1)  # the engine is idle
        assert not stop.is_set() and (line.running, line.background) == (1, 1)

    asyncio.run(main())
