"""Users' releases, served: for a user whose release line has a head, the binding a turn of theirs takes, with
its adapter resident on the scenario's engine.

At most `users.slots` users' adapters are resident per scenario. A turn whose user's adapter is not resident
waits for that load only (materialized from the chain and proven, as any release, before it serves); the least
recently used adapter no turn holds goes out to make room, and a turn waits for one to be free rather than
failing. A user's release serves only on the weights it was made on: once the shared line moves to other
weights, that user is served the shared release (`why` says so) until their line has a release on the new ones.
Knows the chain, the materializer and the registry; nothing of HTTP or tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from reefd.commit.chain import ReleaseChain, ReleaseError, UnknownRelease
from reefd.commit.materialize import Materializer
from reefd.engines import EngineError, EngineUnavailable
from reefd.serve.scenarios import Binding, Registry, Scenario

log = logging.getLogger("reefd.commit.user_lines")


@dataclass
class _Resident:
    binding: Binding
    own: bool  # its adapter was loaded for this user (it takes a slot); else it is the shared one's, or none
    holds: int = 0  # turns being served with it


class _Lines:
    """One scenario's users: their heads, and the bindings resident now (least recently used first)."""

    def __init__(self) -> None:
        self.heads: dict[str, str] = {}  # user -> head release id (users with a line of their own)
        self.resident: OrderedDict[str, _Resident] = OrderedDict()
        self.loading = 0  # slots taken by loads in progress
        self.freed = asyncio.Condition()
        self.locks: dict[str, asyncio.Lock] = {}
        self.why: dict[str, str] = {}  # user -> why their own release does not serve them now

    def taken(self) -> int:
        return self.loading + sum(r.own for r in self.resident.values())


class UserLines:
    def __init__(self, registry: Registry, chain: ReleaseChain, files: Materializer) -> None:
        self.registry, self.chain, self.files = registry, chain, files
        self._lines: dict[str, _Lines] = {}

    def _of(self, scenario: str) -> _Lines:
        return self._lines.get(scenario) or self._lines.setdefault(scenario, _Lines())

    async def read_heads(self, scenario: Scenario) -> None:
        """Learn the heads of the scenario's users' lines from the chain (at start, and after a reload)."""
        lines = self._of(scenario.name)
        lines.why.clear()  # the shared release may have moved: each user's head is looked at again
        heads = await asyncio.to_thread(
            lambda: {u: self.chain.head(scenario.name, u) for u in self.chain.users(scenario.name)})
        lines.heads.update({user: head.id for user, head in heads.items() if head is not None})

    def head(self, scenario: str, user: str) -> str | None:
        """The head of `user`'s line (None: they are on the shared line)."""
        return self._of(scenario).heads.get(user)

    def serving(self, scenario: Scenario, user: str) -> str | None:
        """The release that serves `user`'s next turn: their line's head, unless it is set aside (`why`), else the
        scenario's own."""
        own = self.head(scenario.name, user)
        return own if own is not None and self.why(scenario.name, user) is None else scenario.release

    def why(self, scenario: str, user: str) -> str | None:
        return self._of(scenario).why.get(user)

    async def moved(self, scenario: Scenario, user: str) -> None:
        """`user`'s line has a new head (a commit through reefd): later turns page it in; the old one goes out
        once its turns are done."""
        head = await asyncio.to_thread(self.chain.head, scenario.name, user)
        lines = self._of(scenario.name)
        if head is None:
            lines.heads.pop(user, None)
        else:
            lines.heads[user] = head.id
        lines.why.pop(user, None)
        gone = lines.resident.get(user)
        if gone is not None and gone.binding.release != (head.id if head else None) and gone.holds == 0:
            await self._evict(scenario, lines, user)

    async def forget(self, scenario: Scenario, user: str) -> None:
        """`user` is being deleted: their line no longer serves, and their adapter goes out once its turns end."""
        lines = self._of(scenario.name)
        lines.heads.pop(user, None)
        lines.why.pop(user, None)
        await self._evict(scenario, lines, user, wait=True)

    @contextlib.asynccontextmanager
    async def holding(self, scenario: Scenario, user: str | None) -> AsyncIterator[Binding | None]:
        """The binding a turn of `user` takes, held (resident) until the turn is done; None: the shared one's."""
        lines = self._of(scenario.name)
        head = lines.heads.get(user) if user is not None else None
        if user is None or head is None:
            yield None
            return
        resident = await self._resident(scenario, lines, user, head)
        if resident is None:
            yield None
            return
        resident.holds += 1
        try:
            yield resident.binding
        finally:
            resident.holds -= 1
            async with lines.freed:
                lines.freed.notify_all()

    async def _resident(self, scenario: Scenario, lines: _Lines, user: str, head: str) -> _Resident | None:
        if user in lines.why:  # their head cannot serve now: not tried again until a head moves
            return None
        found = lines.resident.get(user)
        if found is not None and self._current(scenario, found, head):
            lines.resident.move_to_end(user)
            return found
        async with lines.locks.setdefault(user, asyncio.Lock()):
            found = lines.resident.get(user)
            if found is not None and self._current(scenario, found, head):
                return found
            if found is not None:  # an older head of theirs, or one the engine no longer has: out, then in again
                await self._evict(scenario, lines, user, wait=True)
            return await self._page_in(scenario, lines, user, head)

    @staticmethod
    def _current(scenario: Scenario, resident: _Resident, head: str) -> bool:
        """Whether a resident binding still serves: the user's head, on the weights that serve, its adapter loaded
        (a weights swap or an engine's restart may have taken it)."""
        binding, shared = resident.binding, scenario.binding
        return binding.release == head and shared is not None and binding.weights == shared.weights and \
            binding.weights_version == shared.weights_version and \
            (binding.adapter is None or binding.adapter in scenario.engine.adapters)

    async def _page_in(self, scenario: Scenario, lines: _Lines, user: str, head: str) -> _Resident | None:
        shared = scenario.binding
        if shared is None:
            return None
        try:
            rel = await asyncio.to_thread(self.chain.get, head)
        except UnknownRelease:
            return None
        try:
            found = await self.files.artifacts(rel, shared)
        except ReleaseError as exc:
            lines.why[user] = f"{head} cannot be served ({exc}); the shared release serves this user meanwhile"
            return None
        if found.weights != shared.weights:
            lines.why[user] = (f"{head} was made on other weights than the shared release {shared.release} serves; "
                               "the shared release serves this user until their line is retrained")
            return None
        lines.why.pop(user, None)
        on = {"weights": shared.weights, "weights_version": shared.weights_version}
        if found.adapter is None or found.adapter == shared.artifact:
            binding = Binding(rel.id, shared.adapter if found.adapter else None, found.adapter, found.harness,
                              found.harness_tree, **on)
            return self._keep(scenario, lines, user, _Resident(binding, own=False))
        await self._slot(scenario, lines)
        lines.loading += 1
        try:
            adapter = await self.files.load(scenario, rel.id)
        except (ReleaseError, EngineError, OSError) as exc:  # not proven, corrupt, refused: the shared one serves
            lines.why[user] = f"{head} cannot be served ({exc}); the shared release serves this user meanwhile"
            log.error("%s: user %s: %s", scenario.name, user, lines.why[user])
            return None
        finally:
            lines.loading -= 1
        binding = Binding(rel.id, adapter, found.adapter, found.harness, found.harness_tree, **on)
        log.info("%s: paged in %s for user %s", scenario.name, rel.id, user)
        return self._keep(scenario, lines, user, _Resident(binding, own=True))

    def _keep(self, scenario: Scenario, lines: _Lines, user: str, resident: _Resident) -> _Resident:
        lines.resident[user] = resident
        lines.resident.move_to_end(user)
        if resident.binding.adapter is not None:
            self.registry.hold_resident(scenario.engine, resident.binding.adapter, user)
        return resident

    async def _slot(self, scenario: Scenario, lines: _Lines) -> None:
        """Until a slot is free: the least recently used adapter no turn holds goes out."""
        limit = scenario.cfg.users.slots if scenario.cfg.users is not None else 1
        async with lines.freed:
            while lines.taken() >= limit:
                idle = next((u for u, r in lines.resident.items() if r.own and r.holds == 0), None)
                if idle is not None:
                    await self._evict(scenario, lines, idle)
                    continue
                await lines.freed.wait()  # every slot serves a turn now: the first to end frees one

    async def _evict(self, scenario: Scenario, lines: _Lines, user: str, wait: bool = False) -> None:
        """Take `user`'s resident binding out; its adapter is unloaded when nothing else serves it."""
        gone = lines.resident.get(user)
        if gone is None:
            return
        while wait and gone.holds > 0:
            async with lines.freed:
                await lines.freed.wait()
        lines.resident.pop(user, None)
        name = gone.binding.adapter
        if name is None:
            return
        engine = scenario.engine
        self.registry.release_resident(engine, name, user)
        if not gone.own or name in self.registry.adapters(engine) or name not in engine.adapters:
            return
        try:
            await engine.unload_adapter(name)
        except (EngineError, EngineUnavailable) as exc:
            log.warning("%s: unloading user %s's adapter %s failed: %s", scenario.name, user, name, exc)
            return
        await self.files.drop_adapters(f"*/{name}")
        log.info("%s: paged out %s of user %s", scenario.name, name, user)
