"""Full-weight swaps on an SGLang-speaking engine: from disk (held on one process, rolling across replicas), and
from a trainer beside it (its weight update group's broadcast, or its own push). Knows nothing about generating
or launching processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reefd.engines import Drained, EngineError, EngineUnavailable, SwapLimits, Weights
from reefd.engines.replicas import Replica
from reefd.engines.sglang_base import SGLangBase
from reefd.engines.sglang_client import SGLangClient

log = logging.getLogger("reefd.engine")


def only(adapter: tuple[str, Path] | None) -> dict[str, Path]:
    return {adapter[0]: adapter[1]} if adapter is not None else {}


class WeightSwaps(SGLangBase):
    """The WeightSwap and Admits abilities (`swap_weights`, `admit`), and weights a trainer sends."""

    swap_limits = SwapLimits()  # SGLang and the worker reload any weights of their model in place

    async def admit(self) -> None:
        """Wait while new weights load into a single engine process (new requests are held, not refused)."""
        await self._admission.wait()

    async def adopt_weights(self, path: Path | None = None) -> str | None:
        """Take the weights a trainer pushed to this engine's one process, not through reefd (slime's weight
        sync), as what it serves: their version as the server reports it (None when it reports none). `path`: the
        same weights on disk, for a process that restarts. Generation is resumed first, in case the trainer stopped
        between its pause and its continue."""
        async with self._admin:
            client = self._client()
            await client.continue_generation()  # a trainer that died while it was paused
            reported, version = await client.weight_version()
            if reported and version is not None:
                self.weights = Weights(version, path)
            return version if reported else None

    async def swap_weights(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                           switch: Callable[[], None], drained: Drained) -> dict[str, Any]:
        """Serve the weights at `path` (None: the launch model's) as `version`, with `adapter` (name, folder) as
        the only adapter on them; the adapters of the old weights are dropped. `switch()` is called at the moment
        new requests get the new weights, so the caller moves its binding then. Returns what the swap measured.

        One process: new requests are held (`admit`) while the requests taken on the old weights finish and the
        new ones load. Replicas: a rolling swap that holds nothing (`_roll`). A failure leaves the old weights
        serving and raises; weights that `swap_limits` refuse raise first, before any process is touched."""
        self.swap_limits.refuse(path or self.model_dir, version)
        async with self._admin:
            self._client()  # not ready: EngineUnavailable
            started = time.monotonic()
            serving = [] if self.replicas is None else \
                [r for r in self.replicas.replicas if r.state == "ready" and r.worker_id is not None]
            report = await self._swap(path, version, adapter, switch, drained, serving)
            report.update(version=version, total_s=round(time.monotonic() - started, 3), at=time.time())
            keep = {version, self.staged.version if self.staged is not None else version}
            self.proofs = {key: fp for key, fp in self.proofs.items() if key[0] in keep}  # the old ones' go
            self.last_swap = report
            log.info("%s: now serving weights %s (%s)", self.cfg.name, version, report)
            return report

    async def _swap(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                    switch: Callable[[], None], drained: Drained, serving: list[Replica]) -> dict[str, Any]:
        """Held on one process (or one replica left serving), else rolled across the replicas."""
        if len(serving) < 2:
            return await self._swap_held(path, version, adapter, switch, drained, serving)
        return await self._roll(path, version, adapter, switch, drained, serving)

    async def _swap_held(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                         switch: Callable[[], None], drained: Drained, serving: list[Replica]) -> dict[str, Any]:
        """New requests wait while the requests on the old weights finish and every serving process takes the new
        weights and adapter; on a failure each is put back on the old ones (or restarted)."""
        old, new, old_adapters = self.weights, Weights(version, path), dict(self.adapters)
        targets = [self._connect(r.url) for r in serving] if self.replicas is not None else \
            [self._client()]
        done: list[SGLangClient] = []
        async with self._holding() as held:
            await drained(old.version)
            try:
                for client in targets:
                    done.append(client)
                    await self._take(client, new, only(adapter), frozenset(self.adapters))
                    await self._prove(client, version, [None, *only(adapter)])
            except BaseException:
                for client in done:
                    await self._put_back(client, old, old_adapters)
                raise
            for replica in serving:
                replica.weights = version
            self.weights = new
            self.adapters = only(adapter)
            switch()
            return {"replicas": len(targets), "held_s": held()}

    async def _take(self, client: SGLangClient, weights: Weights, adapters: dict[str, Path],
                    unknown: frozenset[str] = frozenset()) -> None:
        """One process: the weights, then `adapters` as its only adapters (`unknown`: the adapters it is taken to
        have when it does not say)."""
        await client.update_weights_from_disk(self._weights_path(weights), weights.version)
        loaded = await client.loaded_adapters()
        have = unknown if loaded is None else loaded
        for name in sorted(have - set(adapters)):
            await client.unload_lora_adapter(name)
        for name, folder in adapters.items():
            if name not in have:
                await client.load_lora_adapter(name, folder)

    async def _put_back(self, client: SGLangClient, weights: Weights, adapters: dict[str, Path]) -> None:
        """After a failed swap: the old weights and adapters, or (when even that fails) a restart of the process,
        which comes back with them (`_restore`)."""
        try:
            await self._take(client, weights, adapters)
        except Exception as exc:
            log.error("%s: %s could not be put back on weights %s (%s); restarting it", self.cfg.name,
                      client.base_url, weights.version, exc)
            self._kill(client.base_url, f"weights revert failed: {exc}")

    async def _roll(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                    switch: Callable[[], None], drained: Drained, serving: list[Replica]) -> dict[str, Any]:
        """A rolling swap. Half the replicas (at least one) are updated one at a time out of the router; then, in
        one step, they return to it while the others leave it, and new requests get the new weights. The others
        finish the requests taken on the old weights (reefd sends them there directly), then are updated one at a
        time and return. No request waits, and none is answered by weights other than those it was taken on."""
        assert self.replicas is not None
        first, rest = serving[:max(1, len(serving) // 2)], serving[max(1, len(serving) // 2):]
        old, new = self.weights, Weights(version, path)
        old_adapters = dict(self.adapters)
        done: list[Replica] = []
        try:
            for replica in first:
                await self.replicas.leave(replica, "updating")
                await self._update(replica, new, only(adapter))
                replica.state = "standby"
                done.append(replica)
        except BaseException:
            for replica in [*done, *(r for r in first if r.state == "updating")]:
                await self._revert(replica, old, old_adapters)
            raise
        return await self._switch_over(done, rest, old, new, only(adapter), switch, drained)

    async def _switch_over(self, done: list[Replica], rest: list[Replica], old: Weights, new: Weights,
                           adapters: dict[str, Path], switch: Callable[[], None], drained: Drained) -> dict[str, Any]:
        """The second half of a rolling swap: the replicas already on the new weights (`done`, standby) return to
        the router while `rest` leave it, new requests get the new weights (`switch`); `rest` finish the requests
        taken on the old ones, then are updated one at a time and return."""
        assert self.replicas is not None
        switched = time.monotonic()
        try:
            for replica in done:
                if replica.state != "standby":  # it died meanwhile: its restart gives it the new weights
                    continue
                await self.replicas.join(replica)
        except BaseException:  # the router refused one: the old weights keep serving, the updated ones restart
            for replica in done:
                if replica.state == "standby" or replica.worker_id is None:
                    self._kill(replica.url, "left out of the router during a weights swap")
            raise
        for replica in rest:
            await self.replicas.leave(replica, "draining")
        self.weights = new
        self.adapters = adapters
        switch()
        switch_s = time.monotonic() - switched
        drain_s = await self._drained_unlocked(drained, old.version)
        for replica in rest:
            if replica.state != "draining":  # it died meanwhile: its restart gives it the new weights
                continue
            replica.state = "updating"
            try:
                await self._update(replica, new, dict(self.adapters))  # with any adapter loaded since the switch
                await self.replicas.join(replica)
            except Exception as exc:  # restarted: a fresh process is given the new weights before it joins
                log.error("%s: replica %d did not take weights %s (%s); restarting it", self.cfg.name,
                          replica.index, new.version, exc)
                self._kill(replica.url, f"weights update failed: {exc}")
        return {"replicas": len(done) + len(rest), "held_s": 0.0, "switch_s": round(switch_s, 3),
                "drain_s": round(drain_s, 3)}

    async def _drained_unlocked(self, drained: Drained, version: str | None) -> float:
        """Wait out the requests taken on `version` (sent to replicas out of the router) with the admin lock
        released: the weights that serve meanwhile take admin calls (a gate's adapter, a crashed replica's
        restore). The seconds it took."""
        started = time.monotonic()
        self._admin.release()
        try:
            await drained(version)
        finally:
            await self._admin.acquire()
        return time.monotonic() - started

    async def _update(self, replica: Replica, weights: Weights, adapters: dict[str, Path]) -> None:
        """One replica out of the router: its running requests finish, then the weights load, its adapters become
        `adapters`, and a generate checks it."""
        client = self._connect(replica.url)
        await self._idle(replica)
        await self._take(client, weights, adapters, frozenset(self.adapters))
        replica.weights = weights.version
        if not await client.healthy():
            raise EngineError(f"replica {replica.index} does not generate after its weights update")
        reported, version = await client.weight_version()
        if reported and version != weights.version:
            raise EngineError(f"replica {replica.index} reports weights {version}, not {weights.version}")
        await self._prove(client, weights.version, [None, *adapters])

    async def _revert(self, replica: Replica, weights: Weights, adapters: dict[str, Path]) -> None:
        """Put a replica back on the old weights and adapters after a failed swap (or restart it)."""
        assert self.replicas is not None
        await self._put_back(self._connect(replica.url), weights, adapters)
        if replica.state == "restarting":
            return
        replica.weights = weights.version
        try:
            await self.replicas.join(replica)
        except Exception as exc:
            self._kill(replica.url, f"did not rejoin the router after a failed weights swap: {exc}")

    async def _idle(self, replica: Replica, timeout_s: float = 900.0) -> None:
        """Until a replica out of the router has finished its requests (as its server info counts them; a server
        that does not count them waits in its own update, as SGLang's does)."""
        deadline = time.monotonic() + timeout_s
        client = self._connect(replica.url)
        while time.monotonic() < deadline:
            info = await client.server_info()
            if "running_requests" not in info or \
                    (replica.direct == 0 and not info.get("running_requests") and not info.get("waiting_requests")):
                return
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------ weights from a trainer beside the engines

    def weight_group_size(self) -> int:
        """The world size of a weight update group with this engine: the trainer (rank 0) and every serving
        process (ranks 1..N)."""
        return 1 + len(self._processes())

    async def join_weight_group(self, master_address: str, master_port: int, *,
                                group_name: str = "weight_update_group", backend: str = "nccl") -> int:
        """Every serving process joins the trainer's weight update group at once (`init_weights_update_group`;
        it returns when the trainer has joined too). Returns the world size."""
        async with self._admin:
            clients = self._processes()
            world = 1 + len(clients)
            await asyncio.gather(*(c.init_weights_update_group(master_address, master_port, rank, world,
                                                               group_name, backend)
                                   for rank, c in enumerate(clients, start=1)))
            self._group = (group_name, [c.base_url for c in clients])
        return world

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, version: str, path: Path | None,
                                              switch: Callable[[], None] | None = None,
                                              drained: Drained | None = None) -> dict[str, Any]:
        """Serve the tensors the trainer broadcasts next (in the order named) as `version`, on every process of
        the group at once: new requests are held while those on the old weights finish and the tensors arrive.
        `path` holds the same weights on disk, for a process that restarts (None: the launch model's, when the
        broadcast only changes what it names for now). A failure restarts the group's processes, which come back
        on the old weights."""
        if self._group is None:
            raise EngineError("no weight update group: join_weight_group first", status=400)
        group, urls = self._group
        async with self._admin:
            clients = [self._connect(u) for u in urls]
            async with self._holding() as held:
                if drained is not None:
                    await drained(self.weights.version)
                results = await asyncio.gather(*(c.update_weights_from_distributed(names, dtypes, shapes, version,
                                                                                   group) for c in clients),
                                               return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    for client in clients:
                        self._kill(client.base_url, f"distributed weight update failed: {failed[0]}")
                    raise failed[0]
                self.weights = Weights(version, path)
                if self.replicas is not None:
                    for replica in self.replicas.replicas:
                        if replica.url in urls:
                            replica.weights = version
                if switch is not None:
                    switch()
                report = {"replicas": len(clients), "held_s": held(), "version": version, "source": "distributed",
                          "at": time.time()}
            self.last_swap = report
            return report

    async def leave_weight_group(self) -> None:
        if self._group is None:
            return
        group, urls = self._group
        self._group = None
        async with self._admin:
            for url in urls:
                with contextlib.suppress(EngineError, EngineUnavailable):
                    await self._connect(url).destroy_weights_update_group(group)
