"""Full weights on trial (the WeightTrial ability): a group of replicas leaves the router and serves the staged
weights to the requests that ask for them (reefd sends those straight to the group), while the router keeps
serving the weights everyone gets; the trial ends with the group back on those, or promoted
(`WeightSwaps.swap_weights` to the staged version). Knows nothing about trials' decisions or sessions."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reefd.engines import Drained, EngineError, Weights
from reefd.engines.replicas import Replica
from reefd.engines.weight_swaps import WeightSwaps, only

log = logging.getLogger("reefd.engine")


class WeightTrials(WeightSwaps):
    @property
    def trial_replicas(self) -> int:
        """As configured (the replicas may not be launched yet): launched ones and attached workers."""
        if self.cfg.replicas <= 1 and not self.cfg.workers:
            return 1
        return (self.cfg.replicas if (self.cfg.source or self.cfg.path) else 0) + len(self.cfg.workers)

    async def stage_weights(self, path: Path | None, version: str, adapter: tuple[str, Path] | None, share: float,
                            drained: Drained) -> dict[str, Any]:
        """Serve the weights at `path` as `version` (with `adapter`, name and folder) on share × the serving
        replicas, out of the router; see WeightTrial."""
        self.swap_limits.refuse(path or self.model_dir, version)  # before an earlier stage ends: nothing changes
        if self.staged is not None and self.staged.version != version:
            await self.end_staged(drained)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while self.replicas is not None and time.monotonic() < deadline and \
                any(r.state == "starting" for r in self.replicas.replicas):  # reefd starting: all its replicas
            await asyncio.sleep(0.1)
        async with self._admin:
            self._client()  # not ready: EngineUnavailable
            if self.staged is not None:  # staged already (the trial's reconcile again)
                return {"replicas": len(self.staged_on), "version": version}
            assert self.replicas is not None  # trial_replicas >= 2
            serving = [r for r in self.replicas.replicas if r.state == "ready" and r.worker_id is not None]
            if len(serving) < 2:
                raise EngineError(f"{version}: full weights go on trial on some of the serving replicas, and "
                                  f"{len(serving)} serve{'s' if len(serving) == 1 else ''} now; retrying")
            group = serving[-min(len(serving) - 1, max(1, math.ceil(share * len(serving)))):]
            started, new = time.monotonic(), Weights(version, path)
            self.staged, self.staged_adapters = new, only(adapter)
            try:
                for replica in group:
                    await self.replicas.leave(replica, "updating")
                    self.staged_on.add(replica.index)
                    await self._update(replica, new, only(adapter))
                    replica.state = "trial"
            except BaseException:
                self.staged, self.staged_on, self.staged_adapters = None, set(), {}
                for replica in group:
                    if replica.state in ("updating", "trial"):
                        await self._revert(replica, self.weights, dict(self.adapters))
                raise
            report = {"replicas": len(group), "of": len(serving), "version": version,
                      "stage_s": round(time.monotonic() - started, 3), "at": time.time()}
            log.info("%s: weights %s on trial on replica(s) %s (%s)", self.cfg.name, version,
                     ", ".join(str(r.index) for r in group), report)
            return report

    async def _swap(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                    switch: Callable[[], None], drained: Drained, serving: list[Replica]) -> dict[str, Any]:
        """A swap to the staged version promotes the trial: its replicas serve everyone without loading again."""
        group = self._promotable(version)
        if group:
            return await self._promote_staged(group, serving, switch, drained)
        if self.staged is not None and self.staged.version == version:  # its replicas restart: they come back
            self.staged, self.staged_on, self.staged_adapters = None, set(), {}  # on `version`, like the rest
        return await super()._swap(path, version, adapter, switch, drained, serving)

    def _promotable(self, version: str) -> list[Replica]:
        """The replicas serving `version` on trial, when it is the staged version (else none)."""
        if self.staged is None or self.staged.version != version or self.replicas is None:
            return []
        return [r for r in self.replicas.replicas if r.index in self.staged_on and r.state == "trial"]

    async def _promote_staged(self, group: list[Replica], serving: list[Replica], switch: Callable[[], None],
                              drained: Drained) -> dict[str, Any]:
        assert self.staged is not None
        new, adapters = self.staged, dict(self.staged_adapters)
        self.staged, self.staged_on, self.staged_adapters = None, set(), {}
        for replica in group:
            replica.state = "standby"
        try:
            report = await self._switch_over(group, serving, self.weights, new, adapters, switch, drained)
        except BaseException:
            if self.weights is not new:  # not switched (the router refused one): the trial goes on where it was
                self.staged, self.staged_on, self.staged_adapters = new, {r.index for r in group}, adapters
                for replica in group:  # one killed on the way comes back staged (`_restore`)
                    if replica.state == "standby":
                        replica.state = "trial"
            raise
        return {**report, "promoted": len(group)}

    async def end_staged(self, drained: Drained) -> dict[str, Any] | None:
        """The group back on the weights that serve, and into the router, once the requests on the staged version
        have finished (none is cut off)."""
        async with self._admin:
            staged = self.staged
            if staged is None or self.replicas is None:
                return None
            group = [r for r in self.replicas.replicas if r.index in self.staged_on]
            self.staged, self.staged_on, self.staged_adapters = None, set(), {}  # a restart now gives them `weights`
            for replica in group:
                if replica.state == "trial":
                    replica.state = "draining"
            started = time.monotonic()
            drain_s = await self._drained_unlocked(drained, staged.version)
            for replica in group:
                if replica.state != "draining":  # restarted meanwhile: it comes back on `weights`
                    continue
                await self._back(replica, staged)
            self.proofs = {key: fp for key, fp in self.proofs.items() if key[0] != staged.version}
            report = {"replicas": len(group), "version": staged.version, "drain_s": round(drain_s, 3),
                      "total_s": round(time.monotonic() - started, 3)}
            log.info("%s: weights %s off trial; back on %s (%s)", self.cfg.name, staged.version,
                     self.weights.version or "the launch weights", report)
            return report

    async def _back(self, replica: Replica, staged: Weights) -> None:
        assert self.replicas is not None
        replica.state = "updating"
        try:
            await self._update(replica, self.weights, dict(self.adapters))
            await self.replicas.join(replica)
        except Exception as exc:  # restarted: a fresh process is given the serving weights before it joins
            log.error("%s: replica %d did not leave weights %s (%s); restarting it", self.cfg.name, replica.index,
                      staged.version, exc)
            self._kill(replica.url, f"weights update failed: {exc}")
