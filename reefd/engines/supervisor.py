"""Keeps one engine process alive: launch, wait until it generates, watch, restart with backoff.

Knows nothing about the contract spoken to the process beyond two callbacks: `ready` (it
generates) and `alive` (it answers at all, even while busy with a full batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable

from reefd.engines.launch import Launched, launch

log = logging.getLogger("reefd.engine")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kill_group(pgid: int) -> None:
    """SIGKILL to a launched process's group (it leads one: start_new_session), so that nothing it started
    outlives it: an engine whose server process died leaves no engine core holding memory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


_SECRET = re.compile(r"key|token|secret|password", re.IGNORECASE)


def masked(argv: list[str]) -> list[str]:
    """The command line fit for a log: values of secret-looking flags become ***."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("-") and _SECRET.search(out[-1]) and "=" not in out[-1]:
            out.append("***")
        elif arg.startswith("-") and "=" in arg and _SECRET.search(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out


class Supervisor:
    """State: starting → ready → (restarting → ready)* → stopped.

    It is ready once `ready(url)` succeeds and `on_launch(url)` (if given) has run; `on_exit(url)` runs when a
    process that was ready is gone, before the next launch. While
    ready, `alive(url)` is asked every HEALTH_INTERVAL_S; three failures in a row count as a
    crash. (Liveness, not generation: a worker busy with long generations must not be killed for
    a slow probe.) Restarts back off exponentially (1 s doubling to 30 s).
    """

    HEALTH_INTERVAL_S = 15.0

    def __init__(self, name: str, argv: Callable[[int], list[str]], ready: Callable[[str], Awaitable[bool]], *,
                 startup_timeout_s: float, alive: Callable[[str], Awaitable[bool]] | None = None,
                 on_launch: Callable[[str], Awaitable[object]] | None = None,
                 on_exit: Callable[[str], Awaitable[None]] | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None):
        self.name = name
        self._argv = argv
        self._ready = ready
        self._alive = alive or ready
        self._on_launch = on_launch
        self._on_exit = on_exit
        self._timeout = startup_timeout_s
        self._host = host
        self._env = None if env is None else {**os.environ, **env}  # added to reefd's own environment
        self.state = "starting"
        self.url = ""
        self.restarts = 0
        self.pid: int | None = None
        self.last_error: str | None = None
        self._proc: Launched | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"supervise-{self.name}")

    async def _run(self) -> None:
        backoff = 1.0
        while not self._stopping:
            started = time.monotonic()
            if await self._launch_once():
                await self._watch()
                if self._on_exit is not None and not self._stopping:  # e.g. take it out of a router
                    self.state = "restarting"
                    try:
                        await self._on_exit(self.url)
                    except Exception as exc:
                        log.warning("%s: clean-up after exit failed: %s", self.name, exc)
            if self._stopping:
                break
            if time.monotonic() - started > 60:  # it ran a good while: not a crash loop
                backoff = 1.0
            log.warning("%s: %s; restarting in %.0f s", self.name, self.last_error, backoff)
            self.state = "restarting"
            self.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _watch(self) -> None:
        """Until the process exits, or stops generating (then it is killed and restarted)."""
        proc = self._proc
        assert proc is not None
        failures = 0
        while not self._stopping:
            try:
                code = await asyncio.wait_for(proc.wait(), self.HEALTH_INTERVAL_S)
            except TimeoutError:
                failures = 0 if await self._alive(self.url) else failures + 1
                if failures >= 3:
                    self.last_error = "engine stopped generating (3 failed health checks)"
                    kill_group(proc.pid)
                    await proc.wait()
                    return
                continue
            kill_group(proc.pid)  # what it started (an engine core, its workers) goes with it
            if not self._stopping:
                self.last_error = f"engine process exited with code {code}"
            return

    async def _launch_once(self) -> bool:
        port = free_port(self._host)
        url = f"http://{self._host}:{port}"
        argv = self._argv(port)
        log.info("%s: launching %s", self.name, " ".join(masked(argv)))
        self._proc = await launch(argv, self._env)  # a process group of its own: its children are killed with it
        self.pid = self._proc.pid
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline and not self._stopping:
            if self._proc.returncode is not None:
                self.last_error = f"engine process exited with code {self._proc.returncode}"
                kill_group(self._proc.pid)
                return False
            if await self._ready(url):
                if self._on_launch is not None:  # e.g. put back the LoRA adapters a restart lost
                    try:
                        await self._on_launch(url)
                    except Exception as exc:
                        self.last_error = f"engine set-up after launch failed: {exc}"
                        await self._terminate()
                        return False
                self.url = url
                self.state = "ready"
                log.info("%s: ready at %s (pid %s)", self.name, url, self.pid)
                return True
            await asyncio.sleep(0.25)
        if self._stopping:
            return False
        self.last_error = f"engine not healthy within {self._timeout:.0f} s"
        await self._terminate()
        return False

    def kill(self, why: str) -> None:
        """Kill the process now (it is restarted as after a crash): for one left in a state reefd cannot repair."""
        if self._proc is not None and self._proc.returncode is None:
            self.last_error = why
            kill_group(self._proc.pid)

    async def _terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM (an engine stops its own children), then whatever is left of its process group is killed."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s: engine did not stop in %.0f s; killing it", self.name, grace_s)
        kill_group(proc.pid)
        await proc.wait()

    async def stop(self) -> None:
        self._stopping = True
        self.state = "stopped"
        await self._terminate()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._terminate()  # a child launched while we were cancelling
