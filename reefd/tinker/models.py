"""A Tinker model: a LoRA on a scenario's base model (the scenario's line, or a user's), trained in its own trainer
process, and the checkpoints it saved. Its requests run one at a time in `seq_id` order, as the SDK numbers them
(each training call takes the next); a request sent again with a seq_id already taken gets the first one's future.

Checkpoints live under STATE/tinker/runs/RUN/{weights,sampler_weights}/NAME (RUN is the model id with `:` as
`-`), each with meta.json (scenario, user, rank, steps), so that `tinker://RUN/weights/NAME` outlives the session
and a restart of reefd.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd.tinker.futures import Failure, Outcome, Result
from reefd.tinker.trainer import SessionTrainer, TrainerFailed

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KINDS = ("weights", "sampler_weights")
META = "meta.json"


class Refused(ValueError):
    """A request that cannot be taken as sent (the route answers 400 with this message)."""


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name.endswith(".tmp"):
        raise Refused(f"path {name!r}: a checkpoint name is 1-128 letters, digits and . _ - (no /), starting with a "
                      "letter or digit")
    return name


@dataclass(frozen=True)
class Checkpoint:
    """A saved state: `tinker://RUN/KIND/NAME`, in `folder`."""

    run: str
    kind: str
    name: str
    folder: Path

    @property
    def path(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"

    def meta(self) -> dict[str, Any]:
        return dict(json.loads((self.folder / META).read_text()))


def parse_path(path: str, root: Path) -> Checkpoint:
    """The checkpoint `tinker://RUN/KIND/NAME` names (Refused when it names none this reefd could have saved)."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
        raise Refused(f"path {path!r} is not tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
    run, kind, name = parts
    if not _NAME.fullmatch(run):
        raise Refused(f"path {path!r}: {run!r} is not a run of this server")
    return Checkpoint(run, kind, check_name(name), root / run / kind / name)


@dataclass
class TinkerModel:
    id: str
    session: str
    scenario: str
    user: str | None
    rank: int
    base: Path  # the base model's folder (its tokenizer too)
    runs: Path  # STATE/tinker/runs
    trainer: SessionTrainer
    vocab_size: int = 0
    steps: int = 0  # optimizer steps applied
    tokens: int = 0  # tokens through forward_backward
    _next: int = 1  # the seq_id whose turn it is
    _taken: dict[int, str] = field(default_factory=dict)  # seq_id -> request id
    _turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    _passes: set[asyncio.Future[Outcome]] = field(default_factory=set)

    @property
    def run(self) -> str:
        return self.id.replace(":", "-")

    def taken(self, seq_id: int) -> str | None:
        """The request id of `seq_id` if it was sent before (the SDK sends a request again after a timeout)."""
        return self._taken.get(seq_id)

    def claim(self, seq_id: int, request_id: str) -> None:
        if seq_id < self._next and seq_id not in self._taken:
            raise Refused(f"seq_id {seq_id} comes after requests already run (next is {self._next})")
        self._taken[seq_id] = request_id

    async def in_turn(self, seq_id: int, work: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """Run `work` once every request numbered before `seq_id` has run (None: now, outside the order)."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._next >= seq_id)
        try:
            return await work()
        finally:
            async with self._turn:
                self._next = max(self._next, seq_id + 1)
                self._turn.notify_all()

    def pass_turn(self, seq_id: int) -> None:
        """`seq_id` was refused before it could run: the requests after it need not wait for it."""
        async def nothing() -> Outcome:
            return Result(json={})

        self._taken.setdefault(seq_id, "")
        self._passes.add(asyncio.ensure_future(self.in_turn(seq_id, nothing)))
        self._passes = {t for t in self._passes if not t.done()}

    async def call(self, req: dict[str, Any]) -> dict[str, Any] | Failure:
        try:
            return await self.trainer.call(req)
        except TrainerFailed as exc:
            return Failure(str(exc), "user" if exc.user else "server")

    def checkpoint(self, kind: str, name: str) -> Checkpoint:
        return Checkpoint(self.run, kind, name, self.runs / self.run / kind / name)

    async def save(self, kind: str, name: str, overwrite: bool) -> Outcome:
        """The model's LoRA (and, for `weights`, its optimizer state) as a checkpoint: written beside its place,
        then renamed into it, so a failed save leaves what was there."""
        point = self.checkpoint(kind, name)
        if point.folder.exists() and not overwrite:
            return Failure(f"{point.path} exists already; save under another name, or pass overwrite=True", "user")
        tmp = point.folder.with_name(name + ".tmp")
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        reply = await self.call({"op": "save", "dir": str(tmp), "optimizer": kind == "weights"})
        if isinstance(reply, Failure):
            return reply
        meta = {"model_id": self.id, "scenario": self.scenario, "user": self.user, "rank": self.rank,
                "steps": self.steps, "tokens": self.tokens}
        await asyncio.to_thread(_publish, tmp, point.folder, meta)
        return Result(json={"type": "save_weights" if kind == "weights" else "save_weights_for_sampler",
                            "path": point.path})

    async def load(self, point: Checkpoint, optimizer: bool) -> Outcome:
        reply = await self.call({"op": "load", "dir": str(point.folder), "optimizer": optimizer})
        if isinstance(reply, Failure):
            return reply
        self.steps = int(point.meta().get("steps", 0))
        return Result(json={"type": "load_weights", "path": point.path, "model_id": self.id})


def _publish(tmp: Path, dest: Path, meta: dict[str, Any]) -> None:
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    readme = tmp / "README.md"  # PEFT's model card: not part of the checkpoint
    readme.unlink(missing_ok=True)
    if dest.exists():
        old = dest.with_name(dest.name + ".old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dest)
