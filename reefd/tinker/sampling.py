"""The Tinker API's sampling: a sampling session samples the scenario's base model, or a saved checkpoint's LoRA
loaded into the scenario's own engine under a name of its own (served to no agent: agents get what their binding
names). Each sample is a record of the scenario (`turn_kind: tinker`, with the token ids, their logprobs and what
sampled them), written before the request's result is given, and its receipt is the sampled sequence's id.

At most MAX_ADAPTERS checkpoints are loaded at once across every session; the one sampled longest ago is unloaded
first, and an ephemeral one (save_weights_and_get_sampling_client's, `ephemeral-SEQ`) is then deleted: an RL loop
saving one a step keeps at most MAX_ADAPTERS on disk. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd.engines import Engine, EngineError, EngineUnavailable, SamplesTokens, TokenSample, TokenSamples
from reefd.observe.records import LOOP_TURNS
from reefd.tinker.futures import Failure, Outcome, Result
from reefd.tinker.models import Checkpoint, Refused

log = logging.getLogger("reefd.tinker")
EPHEMERAL = "ephemeral-"  # the name prefix of save_weights_and_get_sampling_client's checkpoints


@dataclass
class Sampler:
    id: str
    session: str
    scenario: str
    user: str | None
    engine: SamplesTokens
    adapter: str | None  # the loaded checkpoint's name in the engine (None: the base model)
    model_path: str | None
    # seq_id -> (request id, receipts): a request sent again (after a timeout) gets the first one's
    taken: dict[int, tuple[str, list[str]]] = field(default_factory=dict)


@dataclass
class _Loaded:
    engine: Engine
    name: str
    used: float
    folder: Path | None  # an ephemeral checkpoint's: removed once it is unloaded (nothing can name it again)


class Samplers:
    MAX_ADAPTERS = 4
    KEEP_SAMPLED = 4096  # receipts kept per run, for its candidates' lineage

    def __init__(self) -> None:
        self.samplers: dict[str, Sampler] = {}
        self.sampled: dict[str, deque[str]] = {}  # run -> the receipts of what its checkpoints sampled
        self._loaded: OrderedDict[tuple[int, str], _Loaded] = OrderedDict()  # (engine, checkpoint path)
        self._lock = asyncio.Lock()

    async def adapter_for(self, engine: Engine, point: Checkpoint) -> str:
        """The engine's name for `point`'s LoRA, loaded now if it was not (the least recently used goes)."""
        key = (id(engine), point.path)
        async with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                self._loaded[key].used = time.monotonic()
                return self._loaded[key].name
            while len(self._loaded) >= self.MAX_ADAPTERS:
                _, old = self._loaded.popitem(last=False)
                await _unload(old)
            name = f"tinker-{point.run}-{point.kind}-{point.name}"
            if name in engine.adapters:  # loaded before this reefd's bookkeeping (a reload)
                await engine.unload_adapter(name)
            await engine.load_adapter(name, point.folder)
            self._loaded[key] = _Loaded(engine, name, time.monotonic(),
                                        point.folder if point.name.startswith(EPHEMERAL) else None)
            return name

    def get(self, sampler_id: str) -> Sampler:
        return self.samplers[sampler_id]  # KeyError: no such sampler

    def forget_session(self, session: str) -> None:
        for sid in [s.id for s in self.samplers.values() if s.session == session]:
            self.samplers.pop(sid)

    async def close(self) -> None:
        async with self._lock:
            loaded, self._loaded = list(self._loaded.values()), OrderedDict()
        for old in loaded:
            await _unload(old)


async def _unload(old: _Loaded) -> None:
    with contextlib.suppress(EngineError, EngineUnavailable):
        await old.engine.unload_adapter(old.name)
    if old.folder is not None:
        await asyncio.to_thread(shutil.rmtree, old.folder, True)


def sample_work(samplers: Samplers, sampler: Sampler, req: TokenSample, receipts: list[str],
                write: Callable[[dict[str, Any]], Awaitable[None]]) -> Callable[[], Awaitable[Outcome]]:
    """The request's work: sample, write each sample's record (durable before the result is given), then the
    SampleResponse."""
    from reefd.tinker import wire

    async def run() -> Outcome:
        started = time.monotonic()
        try:
            got: TokenSamples = await sampler.engine.sample_tokens(req)
        except EngineError as exc:
            return Failure(str(exc), "user" if exc.status < 500 else "server")
        except EngineUnavailable as exc:
            return Failure(f"the engine is not ready: {exc}", "server")
        for receipt, sample in zip(receipts, got.samples, strict=True):
            await write({
                "id": receipt, "scenario": sampler.scenario, "user": sampler.user, "turn_kind": LOOP_TURNS,
                "tinker": {"session": sampler.session, "sampler": sampler.id, "model_path": sampler.model_path},
                "adapter": sampler.adapter, "release": None, "messages": [],
                "prompt_token_ids": list(req.prompt), "completion_token_ids": sample.tokens,
                "completion_logprobs": sample.logprobs, "finish_reason": "stop" if sample.stopped else "length",
                "sampling": {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                             "max_tokens": req.max_tokens, "seed": req.seed},
                "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(sample.tokens)},
                "latency_s": round(time.monotonic() - started, 6), "finished_at": time.time()})
        if sampler.model_path is not None:  # lineage: what this run's checkpoints sampled
            run = sampler.model_path.removeprefix("tinker://").split("/")[0]
            samplers.sampled.setdefault(run, deque(maxlen=samplers.KEEP_SAMPLED)).extend(receipts)
        prompt_lp = None if got.prompt_logprobs is None else \
            [float("nan") if v is None else v for v in got.prompt_logprobs]
        return Result(proto=wire.sample_response(
            [wire.Sequence(s.tokens, s.logprobs, s.stopped) for s in got.samples], prompt_lp))

    return run


def stop_of(raw: Any) -> list[str] | list[int] | None:
    """Tinker's `stop`: absent or null (the end of text), a string, a list of strings, or of token ids."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and (all(isinstance(s, str) for s in raw) or
                                  all(isinstance(s, int) and not isinstance(s, bool) for s in raw)):
        return raw
    raise Refused("sampling_params.stop: a string, a list of strings, or a list of token ids")
