"""The Tinker API's state in reefd: sessions (kept alive by the SDK's heartbeat), the models trained in them, and
the futures their requests answer with. Bounded: at most `Limits.sessions` sessions and `Limits.models` models
(each holds a base model in a trainer process) at once; a session that sends no heartbeat for `idle_s` is closed
and its models' trainers stopped (their saved checkpoints stay). Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd.tinker.futures import Failure, Futures, Outcome, Result, TooMany
from reefd.tinker.models import Checkpoint, Refused, TinkerModel, parse_path
from reefd.tinker.sampling import Samplers
from reefd.tinker.trainer import SessionTrainer, TrainerFailed

log = logging.getLogger("reefd.tinker")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Limits:
    sessions: int = 16
    models: int = 2  # trainer processes, each with a copy of its base model in memory
    max_rank: int = 128
    request_tokens: int = 1 << 20  # tokens in one forward_backward request
    idle_s: float = 120.0  # without a heartbeat (the SDK sends one every 10 s)


class NotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class TinkerSession:
    id: str
    owner: str  # the token that opened it
    seen: float
    models: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class NewModel:
    """What create_model (or a create from a checkpoint) asks for, once the route has checked who asks."""

    session: str
    seq: int
    scenario: str
    user: str | None
    base: Path
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    seed: int = 0


Offer = Callable[[str, str | None, Path, dict[str, Any]], Awaitable[Any]]  # (scenario, user, folder, meta) -> job


class Tinker:
    """`offer`: hands a checkpoint to the line's gate (the scheduler's `offer`; reefd/loop.py wires it), returning
    the job that judges it."""

    def __init__(self, state_dir: Path, limits: Limits | None = None, offer: Offer | None = None) -> None:
        self.limits = limits or Limits()
        self.offer = offer
        self.runs = state_dir / "tinker" / "runs"
        self.work = state_dir / "tinker" / "trainers"
        self.futures = Futures()
        self.sessions: dict[str, TinkerSession] = {}
        self.models: dict[str, TinkerModel] = {}
        self.samplers = Samplers()
        self._creating: dict[str, str] = {}  # model id -> its create request's id
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="tinker-sessions")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.futures.close()
        await asyncio.gather(*(m.trainer.stop() for m in self.models.values()), return_exceptions=True)
        self.models.clear()
        await self.samplers.close()

    # ------------------------------------------------------------------ sessions

    def create_session(self, owner: str) -> str:
        if len(self.sessions) >= self.limits.sessions:
            raise TooMany(f"{len(self.sessions)} Tinker sessions are open, the most this reefd keeps "
                          f"({self.limits.sessions}); close one (ServiceClient.close) or wait for an idle one to end")
        session = TinkerSession(f"sess-{secrets.token_hex(8)}", owner, time.monotonic())
        self.sessions[session.id] = session
        return session.id

    def session(self, session_id: str, owner: str) -> TinkerSession:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"no open session {session_id!r} (it ended, or was never opened by this token)")
        session.seen = time.monotonic()
        return session

    async def close_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.samplers.forget_session(session_id)
        models = [self.models.pop(m) for m in session.models if m in self.models]
        await asyncio.gather(*(m.trainer.stop() for m in models), return_exceptions=True)
        log.info("Tinker session %s closed (%d models)", session_id, len(models))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, self.limits.idle_s / 4))
            now = time.monotonic()
            for sid in [s.id for s in self.sessions.values() if now - s.seen > self.limits.idle_s]:
                log.warning("Tinker session %s sent no heartbeat for %.0f s: closing it", sid, self.limits.idle_s)
                await self.close_session(sid)

    # ------------------------------------------------------------------ models

    def model(self, model_id: str, owner: str) -> TinkerModel:
        model = self.models.get(model_id)
        if model is None or self.sessions.get(model.session, TinkerSession("", "", 0)).owner != owner:
            raise NotFound(f"no model {model_id!r} in an open session of this token")
        self.sessions[model.session].seen = time.monotonic()
        return model

    def create_model(self, new: NewModel, owner: str, then: Checkpoint | None = None,
                     optimizer: bool = False) -> str:
        """Start a model's trainer (and load `then` into it): the future's request id. The same model asked for
        again (the SDK sends a request again after a timeout) gets the first request's id."""
        model_id = f"{new.session}:train:{new.seq}"
        session = self.session(new.session, owner)
        if model_id in self._creating and model_id in self.models:
            return self._creating[model_id]
        if model_id in self.models:
            raise Refused(f"model_seq_id {new.seq} is taken in session {new.session}")
        if len(self.models) >= self.limits.models:
            raise TooMany(f"{len(self.models)} Tinker models are training, the most this reefd holds at once "
                          f"({self.limits.models}); end a session (ServiceClient.close) to free one")
        if not 1 <= new.rank <= self.limits.max_rank:
            raise Refused(f"lora_config.rank {new.rank}: reefd trains ranks 1 to {self.limits.max_rank}")
        modules = (ATTENTION if new.train_attn else ()) + (MLP if new.train_mlp else ())
        if not modules:
            raise Refused("lora_config: train_attn and train_mlp are both false: the LoRA would train nothing")
        model = TinkerModel(model_id, new.session, new.scenario, new.user, new.rank, new.base, self.runs,
                            SessionTrainer(self.work / model_id.replace(":", "-")))
        self.models[model_id] = model
        session.models.add(model_id)
        init = {"base_model": str(new.base), "rank": new.rank, "alpha": 2 * new.rank, "seed": new.seed,
                "target_modules": list(modules)}

        async def start() -> Outcome:
            try:
                ready = await model.trainer.start(init)
            except (TrainerFailed, OSError) as exc:
                self.models.pop(model_id, None)
                return Failure(f"the model's trainer did not start: {exc}", "server")
            model.vocab_size = int(ready["vocab_size"])
            if then is not None:
                loaded = await model.load(then, optimizer)
                if isinstance(loaded, Failure):
                    return loaded
            return Result(json={"type": "load_weights" if then else "create_model", "model_id": model_id,
                                "path": then.path if then else None})

        self._creating[model_id] = self.futures.submit(start(), "create")
        return self._creating[model_id]

    def submit(self, model: TinkerModel, seq_id: int, kind: str, work: Callable[[], Awaitable[Outcome]]) -> str:
        """Queue `work` as `model`'s request `seq_id`: the future's request id (the first one's, for a seq_id
        sent again)."""
        if (earlier := model.taken(seq_id)) is not None:
            return earlier
        request_id = self.futures.submit(model.in_turn(seq_id, work), kind)
        model.claim(seq_id, request_id)
        return request_id

    def checkpoint(self, path: str, owner_scenarios: Callable[[str], bool]) -> Checkpoint:
        """The saved checkpoint `path` names, if the asking token covers its scenario (NotFound otherwise)."""
        point = parse_path(path, self.runs)
        if not (point.folder / "meta.json").is_file() or not owner_scenarios(point.meta()["scenario"]):
            raise NotFound(f"no checkpoint {path}")
        return point
