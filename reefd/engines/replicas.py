"""Engine replicas behind SGLang's router (PyPI `sglang-router`): N launched workers and any attached ones, one
router process in front of them.

The router is started with no workers. A replica joins it (`POST /workers`) only once it is healthy and has the
serving adapters (`restore`), and leaves it (`DELETE /workers/{id}`) when its process dies; its supervisor then
restarts it and it joins again. The router answers 404 on the admin routes, so admin calls go to every replica
directly (`urls`). Requests carry `X-SMG-Routing-Key` (the router's `manual` policy keeps a key on one replica).
A router that restarts gets every ready replica again. Knows nothing about chat templates or records.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from reefd.engines.supervisor import Supervisor, free_port

log = logging.getLogger("reefd.engine")

ROUTING_HEADER = "X-SMG-Routing-Key"
SERVING = ("ready", "trial")  # the states in which a replica answers requests (through the router, or directly)
Restore = Callable[[str, Callable[[], None]], Awaitable[None]]
"""(url, joined): give the replica at url the serving adapters, then call joined() while no admin call can run."""


@dataclass
class Replica:
    """One engine process reefd launched (with its supervisor) or one it attached to by URL."""

    index: int
    url: str = ""
    supervisor: Supervisor | None = None
    worker_id: str | None = None  # the router's id for it, while it is in the router
    attached: bool = False
    # starting | ready | unhealthy | restarting | stopped; during a weights swap also updating (out of the router),
    # standby (updated, waiting for the switch) and draining (old weights, out of the router, finishing requests);
    # trial: serving weights on trial, out of the router (reefd sends their requests to it directly)
    state: str = "starting"
    weights: str | None = None  # the weight version it serves (a release id; None: the weights it launched with)
    direct: int = 0  # requests sent to it directly (a request on old weights during a swap), in flight

    def describe(self) -> dict[str, Any]:
        sup = self.supervisor
        return {"replica": self.index, "url": self.url, "state": self.state, "in_router": self.worker_id is not None,
                "weights": self.weights, "attached": self.attached, "pid": sup.pid if sup else None,
                "restarts": sup.restarts if sup else 0, "last_error": sup.last_error if sup else None}


class Replicas:
    """The replicas of one model and the router in front of them."""

    REPAIR_INTERVAL_S = 10.0

    def __init__(self, name: str, session: aiohttp.ClientSession, argv: Callable[[int], list[str]],
                 healthy: Callable[[str], Awaitable[bool]], alive: Callable[[str], Awaitable[bool]],
                 restore: Restore, *, launched: int, attached: list[str], tokenizer: Path,
                 startup_timeout_s: float, router_args: list[str] | None = None,
                 repair: Callable[[], Awaitable[list[str]]] | None = None, env: dict[str, str] | None = None) -> None:
        self.name, self.session = name, session
        self._argv, self._healthy, self._alive, self._restore = argv, healthy, alive, restore
        self._repair = repair
        self.env = env  # added to each launched replica's environment
        self.tokenizer, self.startup_timeout_s = tokenizer, startup_timeout_s
        self.router_args = list(router_args or [])
        self.replicas = [Replica(i) for i in range(launched)]
        self.replicas += [Replica(launched + i, url=url.rstrip("/"), attached=True) for i, url in enumerate(attached)]
        self.router: Supervisor | None = None
        self.metrics_port = 0
        self._lock = asyncio.Lock()  # router membership changes one at a time
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.metrics_port = free_port()
        self.router = Supervisor(f"{self.name}/router", self._router_argv, self._router_up,
                                 startup_timeout_s=60.0, on_launch=self._router_launched)
        self.router.start()
        for replica in self.replicas:
            if replica.attached:
                self._spawn(self._watch_attached(replica))
                continue
            replica.supervisor = Supervisor(
                f"{self.name}/{replica.index}", self._argv, self._healthy, alive=self._alive,
                on_launch=functools.partial(self._joined, replica), on_exit=functools.partial(self._exited, replica),
                startup_timeout_s=self.startup_timeout_s, env=self.env)
            replica.supervisor.start()
        if self._repair is not None:
            self._spawn(self._repairs())

    async def _repairs(self) -> None:
        """The reconcile pass, every REPAIR_INTERVAL_S: a replica whose adapters differ from what is served (one
        that lost an adapter, or kept one it should have dropped) is put right."""
        assert self._repair is not None
        while True:
            await asyncio.sleep(self.REPAIR_INTERVAL_S)
            try:
                await self._repair()
            except Exception as exc:  # an engine call failed: the next pass tries again
                log.warning("%s: replica repair pass failed: %s", self.name, exc)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas:
            replica.state = "stopped"
            if replica.supervisor is not None:
                await replica.supervisor.stop()
        if self.router is not None:
            await self.router.stop()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ the router

    def _router_argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "manual", "--tokenizer-path", str(self.tokenizer), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.metrics_port), "--log-level", "warn", *self.router_args]

    async def _router_up(self, url: str) -> bool:
        try:
            async with self.session.get(f"{url}/workers", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _router_launched(self, url: str) -> None:
        """A (re)started router knows no worker: every ready replica joins it."""
        for replica in self.replicas:
            replica.worker_id = None
        for replica in self.replicas:
            if replica.state == "ready":
                try:
                    await self._add(url, replica)
                except Exception as exc:  # one replica must not take the router down with it
                    log.warning("%s: replica %d did not rejoin the router: %s", self.name, replica.index, exc)

    @property
    def router_url(self) -> str:
        return self.router.url if self.router is not None and self.router.state == "ready" else ""

    async def _add(self, router: str, replica: Replica) -> None:
        async with self._lock:
            async with self.session.post(f"{router}/workers", json={"url": replica.url},
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                body = orjson.loads(await r.read() or b"{}")
                if r.status >= 300:
                    raise RuntimeError(f"the router refused {replica.url}: {r.status} {body}")
            replica.worker_id = body.get("worker_id")
            # the router adds a worker in the background (listed after ~10 ms here): wait until it lists it
            for _ in range(1000):
                if replica.url in await self._listed(router):
                    log.info("%s: replica %d (%s) joined the router", self.name, replica.index, replica.url)
                    return
                await asyncio.sleep(0.01)
            raise RuntimeError(f"the router did not list {replica.url} within 10 s")

    async def _remove(self, replica: Replica) -> None:
        router, worker = self.router_url, replica.worker_id
        replica.worker_id = None
        if not router or worker is None:
            return
        async with self._lock:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.delete(f"{router}/workers/{worker}",
                                               timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()

    async def _listed(self, router: str) -> dict[str, dict[str, Any]]:
        async with self.session.get(f"{router}/workers", timeout=aiohttp.ClientTimeout(total=10)) as r:
            doc = orjson.loads(await r.read())
        return {str(w.get("url", "")).rstrip("/"): w for w in doc.get("workers") or []}

    async def workers(self) -> dict[str, dict[str, Any]]:
        """The router's view of its workers by URL (health, load), or {} when it cannot be asked."""
        router = self.router_url
        if not router:
            return {}
        try:
            return await self._listed(router)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return {}

    # ------------------------------------------------------------ replicas joining and leaving

    async def _joined(self, replica: Replica, url: str) -> None:
        """A launched replica is healthy: give it the serving adapters, then add it to the router."""
        replica.url, replica.state = url, "starting"
        await self._restore(url, functools.partial(setattr, replica, "state", "ready"))
        if self.router_url and replica.state != "trial":  # on trial: served directly, out of the router
            try:
                await self._add(self.router_url, replica)
            except Exception:  # not in the router: not a replica admin calls reach either
                replica.state = "restarting" if not replica.attached else "unhealthy"
                raise

    async def _exited(self, replica: Replica, url: str) -> None:
        await self._left(replica, f"its process at {url} is gone")

    async def _left(self, replica: Replica, why: str) -> None:
        replica.state = "restarting" if not replica.attached else "unhealthy"
        log.warning("%s: replica %d leaves the router: %s", self.name, replica.index, why)
        await self._remove(replica)

    async def _watch_attached(self, replica: Replica) -> None:
        """An attached worker cannot be restarted by reefd: it joins while healthy and leaves while it is not."""
        failures = 0
        while True:
            healthy = await self._alive(replica.url)
            if healthy and replica.state in SERVING:
                failures = 0
            if healthy and replica.state in ("starting", "unhealthy"):  # not one a weights swap or trial holds
                try:
                    if await self._healthy(replica.url):
                        await self._joined(replica, replica.url)
                except Exception as exc:  # its adapters or the router refused: try again later
                    log.warning("%s: attached replica %s not joined: %s", self.name, replica.url, exc)
                    replica.state = "unhealthy"
                failures = 0
            elif not healthy:
                failures += 1
                if failures >= 3 and replica.state in SERVING:  # on trial: it comes back on trial
                    await self._left(replica, "3 failed health checks")
            await asyncio.sleep(Supervisor.HEALTH_INTERVAL_S if replica.state in SERVING else 2.0)

    # ------------------------------------------------------------ a weights swap moves replicas in and out

    async def leave(self, replica: Replica, state: str) -> None:
        """Take a serving replica out of the router (its running requests go on): `updating` or `draining`."""
        replica.state = state
        await self._remove(replica)

    async def join(self, replica: Replica) -> None:
        """Put an updated replica (back) into the router."""
        replica.state = "ready"
        if self.router_url:
            await self._add(self.router_url, replica)

    # ------------------------------------------------------------ what the engine asks

    def urls(self) -> list[str]:
        """The replicas that serve now (admin calls go to each)."""
        return [r.url for r in self.replicas if r.state == "ready" and r.url]

    @property
    def ready(self) -> bool:
        """Some replica serves: through the router, or straight while the router is down or has not taken it in
        yet (direct())."""
        return bool(self.direct())

    def direct(self) -> list[Replica]:
        """The replicas a request may be sent to straight, while the router is down (or failed to take it)."""
        return [r for r in self.replicas if r.state == "ready" and r.url]

    @property
    def state(self) -> str:
        if self.router is None:
            return "starting"
        if self.ready:
            serving = sum(1 for r in self.replicas if (r.state == "ready" and r.worker_id) or r.state == "trial")
            return "ready" if self.router_url and serving == len(self.replicas) else "degraded"
        return "restarting" if self.router.state == "restarting" else "starting"

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.replicas]
