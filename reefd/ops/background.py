"""Background tasks an owner starts and cancels as a group: each kept until it ends, and a failure logged with the
task's name (an exception nobody awaits would otherwise surface only as asyncio's "never retrieved" warning)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self, log: logging.Logger) -> None:
        self.log = log  # where a failed task is reported
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run `coro` as a task named `name` until it ends or `cancel` is called."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def cancel(self) -> None:
        """Cancel every task still running and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
