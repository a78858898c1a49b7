"""The state the parts of an SGLang-speaking engine share (its config, processes, served weights and adapters, its
admin lock) and the ways to reach its processes. Knows nothing about generating, swapping or launching."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from reefd.engines import EngineUnavailable, ModelConfig, Weights
from reefd.engines.proof import Fingerprint, ProofFailed
from reefd.engines.replicas import Replicas
from reefd.engines.sglang_client import SGLangClient
from reefd.engines.supervisor import Supervisor
from reefd.serve.chat import ChatTemplate


class SGLangBase:
    """What every part of SGLangEngine reads and writes: one process (`supervisor`, or an attached `client`) or
    several behind sglang-router (`replicas`)."""

    def __init__(self, cfg: ModelConfig, state_dir: Path, session: aiohttp.ClientSession):
        self.kind = cfg.engine
        self.cfg = cfg
        self.state_dir = state_dir
        self.session = session
        self.template: ChatTemplate | None = None
        self.context_length: int | None = cfg.context_length
        self.model_dir: Path | None = Path(cfg.path) if cfg.path else None
        self.supervisor: Supervisor | None = None
        self.client: SGLangClient | None = None
        self._state = "starting"
        self._task: asyncio.Task[None] | None = None
        self.adapters: dict[str, Path] = {}  # loaded LoRA adapters, put back after every restart
        self.replicas: Replicas | None = None  # several replicas behind sglang-router (model.replicas, workers)
        self._admin = asyncio.Lock()  # adapter and weight changes, and the replicas' repair pass, one at a time
        self.repairs = 0
        self.weights = Weights()  # what new requests get; a (re)started process is given them before it serves
        self.staged: Weights | None = None  # full weights on trial on a group of replicas out of the router
        self.staged_on: set[int] = set()  # that group (replica indexes): a restart gives them the staged weights
        self.staged_adapters: dict[str, Path] = {}  # the adapter served on the staged weights, if any
        self._admission = asyncio.Event()  # cleared while one engine process loads new weights: new requests wait
        self._admission.set()
        self.last_swap: dict[str, Any] | None = None  # the last weights swap: when, how long, how long requests held
        self._group: tuple[str, list[str]] | None = None  # a trainer's weight update group: its name, its processes
        # (weight version, adapter) -> what a process serving them must answer (reefd/engines/proof.py); set by
        # the release's materializer before the load or swap
        self.proofs: dict[tuple[str | None, str | None], Fingerprint] = {}
        self.last_proof: dict[str, Any] | None = None  # the last process proven: what, where, how long, verdict

    @property
    def ready(self) -> bool:
        if self.replicas is not None:
            return self.template is not None and self.replicas.ready
        return self.template is not None and self.state == "ready"

    @property
    def state(self) -> str:
        if self.replicas is not None:
            return self.replicas.state
        return self.supervisor.state if self.supervisor is not None else self._state

    def _client(self) -> SGLangClient:
        if not self.ready:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} is {self.state}; "
                                    "retry shortly", retry_after=2)
        if self.replicas is not None:  # generation goes through the router (while it is down: a replica)
            url = self.replicas.router_url or self.replicas.direct()[0].url
            if self.client is None or self.client.base_url != url:
                self.client = self._connect(url, router=bool(self.replicas.router_url))
            return self.client
        if self.supervisor is not None and (self.client is None or self.client.base_url != self.supervisor.url):
            self.client = self._connect(self.supervisor.url)
        assert self.client is not None
        return self.client

    def _connect(self, url: str, router: bool = False) -> SGLangClient:
        """A client for one of this engine's processes (`router`: for sglang-router in front of them)."""
        return SGLangClient(self.session, url)

    def _processes(self) -> list[SGLangClient]:
        """Every process serving now: each replica directly (the router 404s admin calls), or the one process."""
        if self.replicas is None:
            return [self._client()]
        return [self._connect(u) for u in self.replicas.urls()]

    @contextlib.asynccontextmanager
    async def _holding(self) -> AsyncIterator[Callable[[], float]]:
        """New requests wait (`admit`) for the block; yields a function giving the seconds held so far."""
        self._admission.clear()
        started = time.monotonic()
        try:
            yield lambda: round(time.monotonic() - started, 3)
        finally:
            self._admission.set()

    async def _prove(self, client: SGLangClient, weights: str | None, adapters: Iterable[str | None]) -> None:
        """ProofFailed unless `client`'s process answers the fingerprint of each of `adapters` (None: the weights
        alone) on `weights` that this engine holds one for: each probe prompt with the reference's tokens after
        it, teacher-forced, all at once (the weights' beside the adapters', since an engine may answer each alone
        right and a mixed batch wrong)."""
        proven = [(a, fp) for a in dict.fromkeys(adapters) if (fp := self.proofs.get((weights, a))) is not None]
        if not proven:
            return
        started = time.monotonic()
        probes = [client.teacher_forced(prompt, tokens, adapter)
                  for adapter, fp in proven for prompt, tokens in zip(fp.prompts, fp.tokens, strict=True)]
        answers = list(await asyncio.gather(*probes))
        for adapter, fp in proven:
            problem = fp.mismatch(answers[:len(fp.prompts)])
            answers = answers[len(fp.prompts):]
            self.last_proof = {"weights": weights, "adapter": adapter, "url": client.base_url, "at": time.time(),
                               "s": round(time.monotonic() - started, 4), "problem": problem}
            if problem is not None:
                what = f"adapter {adapter}" if adapter is not None else "its weights"
                raise ProofFailed(f"{client.base_url} does not answer as {what} on weights "
                                  f"{weights or 'as launched'} should: {problem}")

    def _weights_path(self, weights: Weights) -> Path:
        path = weights.path or self.model_dir
        if path is None:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} has no model folder yet")
        return path

    def _kill(self, url: str, why: str) -> None:
        if self.replicas is not None:
            for replica in self.replicas.replicas:
                if replica.url == url and replica.supervisor is not None:
                    replica.state = "restarting"
                    replica.supervisor.kill(why)
                elif replica.url == url:  # attached: its watcher gives it the weights again, then it rejoins
                    replica.state = "unhealthy"
        elif self.supervisor is not None:
            self.supervisor.kill(why)
