"""Who a scenario's users are: the `users:` block that turns per-user learning on, and the users each scenario
has seen (STATE/users/<scenario>.json), bounded by `users.max`.

A user is a name a scoped token carries or a root or scenario token sends in `x-reef-user` (reefd/api/access.py
resolves which). One nobody has seen before is admitted here, durably, before its first turn is served, and
starts on the scenario's shared release. Knows nothing of HTTP, tokens or the chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd.ops.files import write_json


@dataclass
class UsersConfig:
    """Per-user learning: each user of the scenario is known by name (docs/users.md)."""

    max: int = field(default=1000, metadata={
        "minimum": 1, "maximum": 1_000_000,
        "description": "At most this many users; a new user past it is refused, saying why."})
    slots: int = field(default=8, metadata={
        "minimum": 1, "maximum": 4096,
        "description": "Users' own adapters resident on the engine at once; others are paged in from the chain "
                       "when their user's turn comes, least recently used out."})
    tasks: str | None = field(default=None, metadata={
        "description": "A user's own gate tasks: a path relative to the scenarios folder in which `{user}` stands "
                       "for the user's name (e.g. gate/assist/{user}.jsonl). A user's candidate is gated on their "
                       "file where it exists, on gate.tasks otherwise."})

    share: bool = field(default=False, metadata={
        "description": "Promotion: the shared line may learn from what users who consent (reefctl users share) "
                       "taught their own releases, by `reefctl train NAME --promote`, through the scenario's gate."})
    share_min_users: int = field(default=2, metadata={
        "minimum": 1, "maximum": 1_000_000,
        "description": "A promotion runs only on the records of at least this many consenting users' releases."})

    def tasks_of(self, user: str | None, scenarios_dir: Path) -> str | None:
        """The gate tasks file of `user`'s candidates, when `tasks` names one that exists (blocking stat)."""
        if user is None or self.tasks is None:
            return None
        own = self.tasks.replace("{user}", user)  # a user's name holds no `/` or `..`: it stays one path segment
        return own if (scenarios_dir / own).is_file() else None


class UsersFull(Exception):
    """A new user, and the scenario already has its `users.max` users."""

    def __init__(self, scenario: str, user: str, limit: int) -> None:
        super().__init__(f"scenario {scenario!r} already has its {limit} users (users.max), so user {user!r} "
                         "cannot be added: raise users.max, or delete a user")
        self.scenario, self.user, self.limit = scenario, user, limit


class BeingDeleted(Exception):
    """A turn of a user whose deletion is under way."""

    def __init__(self, scenario: str, user: str) -> None:
        super().__init__(f"user {user!r} of scenario {scenario!r} is being deleted; nothing of theirs is served or "
                         "stored meanwhile")
        self.scenario, self.user = scenario, user


class Users:
    """The users each scenario has seen: name → when first seen, kept in one JSON file per scenario."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._known: dict[str, dict[str, dict[str, Any]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.deleting: set[tuple[str, str]] = set()  # (scenario, user): their turns are refused meanwhile
        self._turns: Counter[tuple[str, str]] = Counter()  # (scenario, user) -> their turns being served

    def _path(self, scenario: str) -> Path:
        return self.folder / f"{scenario}.json"

    def known(self, scenario: str) -> dict[str, dict[str, Any]]:
        """Every user of `scenario` with what is kept of them ({"since": epoch seconds}), read once."""
        found = self._known.get(scenario)
        if found is None:
            try:
                doc = json.loads(self._path(scenario).read_text(encoding="utf-8"))
                found = dict(doc["users"])
            except FileNotFoundError:
                found = {}
            self._known[scenario] = found
        return found

    async def _keep(self, scenario: str, users: dict[str, dict[str, Any]]) -> None:
        """`scenario`'s users are now `users`: written and fsynced, then cached (under the scenario's lock)."""
        await asyncio.to_thread(write_json, self._path(scenario), {"users": users}, indent=1)
        self._known[scenario] = users

    async def admit(self, scenario: str, user: str, cfg: UsersConfig) -> bool:
        """Make sure `user` is one of `scenario`'s users (durably, before the caller serves it); True when new.
        UsersFull when it would be one more than `cfg.max`; BeingDeleted while their deletion runs."""
        if (scenario, user) in self.deleting:
            raise BeingDeleted(scenario, user)
        if user in self.known(scenario):
            return False
        async with self._locks.setdefault(scenario, asyncio.Lock()):
            known = self.known(scenario)
            if user in known:
                return False
            if len(known) >= cfg.max:
                raise UsersFull(scenario, user, cfg.max)
            await self._keep(scenario, {**known, user: {"since": round(time.time(), 3)}})
            return True

    @contextlib.asynccontextmanager
    async def turn(self, scenario: str, user: str, cfg: UsersConfig) -> AsyncIterator[None]:
        """One turn of `user` (admitted first), counted until its record is written: a deletion waits for it."""
        await self.admit(scenario, user, cfg)
        self._turns[(scenario, user)] += 1
        try:
            yield
        finally:
            self._turns[(scenario, user)] -= 1

    async def quiet(self, scenario: str, user: str, timeout_s: float) -> None:
        """Until no turn of `user` (its deletion under way: none starts) is being served, or `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._turns[(scenario, user)] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def sharing(self, scenario: str) -> list[str]:
        """The users of `scenario` who consent to the shared line learning from their releases' records."""
        return sorted(u for u, entry in self.known(scenario).items() if entry.get("share") is True)

    async def set_share(self, scenario: str, user: str, share: bool) -> bool:
        """Record `user`'s consent (or its withdrawal), durably; False when they are not one of the users."""
        async with self._locks.setdefault(scenario, asyncio.Lock()):
            known = self.known(scenario)
            if user not in known:
                return False
            await self._keep(scenario, {**known, user: {**known[user], "share": share}})
            return True

    async def forget(self, scenario: str, user: str) -> bool:
        """`user` is no longer one of `scenario`'s users (their deletion); False when they were not one."""
        async with self._locks.setdefault(scenario, asyncio.Lock()):
            known = self.known(scenario)
            if user not in known:
                return False
            await self._keep(scenario, {k: v for k, v in known.items() if k != user})
            return True
