"""Engines that speak SGLang's HTTP contract (the embedded worker, a real SGLang server): launching, attaching,
restoring and describing their processes; generation, adapters and weights are its parts' (generation, lora,
weight_swaps). Token in, token out: the record keeps the engine's own ids and logprobs. Knows no wire formats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from reefd.engines import EngineConfig, EngineError, TokenSample, TokenSamples, token_sampling
from reefd.engines.generation import Generation
from reefd.engines.kind_configs import SGLangConfig, WorkerConfig
from reefd.engines.launch import die_with_parent
from reefd.engines.lora import Adapters
from reefd.engines.prepared import is_complete
from reefd.engines.replicas import Replica, Replicas
from reefd.engines.sglang_client import launch_or
from reefd.engines.supervisor import Supervisor
from reefd.engines.weight_trials import WeightTrials
from reefd.serve.chat import ChatTemplate

log = logging.getLogger("reefd.engine")

INCREMENTAL = ["--incremental-streaming-output"]
"""Launched engines stream only what is new on each event: SGLang's default repeats the whole answer so far, which
makes a long answer cost quadratic bytes and time. Attached servers may stream either way; both are read."""


class SGLangEngine(Generation, Adapters, WeightTrials):
    """`engine: sglang` (launched or attached), and the base of `engine: worker` (launched `reefd.worker`)."""

    Config: ClassVar[type[EngineConfig]] = SGLangConfig
    attaches: ClassVar[bool] = True  # `model.url` attaches to a server already running

    async def start(self) -> None:
        self._task = asyncio.create_task(self._start(), name=f"engine-{self.cfg.name}")

    async def _start(self) -> None:
        try:
            if self.cfg.replicas > 1 or self.cfg.workers:
                await self._start_replicas()
                return
            if self.attaches and self.cfg.url:
                await self._attach(self.cfg.url)
                return
            if self.model_dir is None:
                assert self.cfg.source is not None
                self.model_dir = await self._prepare(self.cfg.source)
            await asyncio.to_thread(self._load_template, self.model_dir)  # reads the tokenizer: off the loop
            self.supervisor = Supervisor(
                self.cfg.name, self._argv, self._healthy, alive=self._alive, on_launch=self._restore,
                startup_timeout_s=self.cfg.startup_timeout_s, env=self._env())
            self.supervisor.start()
        except Exception as exc:  # keep reefd up; the scenario reports the failure
            log.error("%s: engine failed to start: %s", self.cfg.name, exc)
            self._state = "failed"

    async def _start_replicas(self) -> None:
        """model.replicas launched engines plus model.workers attached ones, behind sglang-router."""
        launched = self.cfg.replicas if (self.cfg.source or self.cfg.path) else 0
        if self.model_dir is None and self.cfg.source is not None:
            self.model_dir = await self._prepare(self.cfg.source)
        if self.model_dir is None:  # attached workers only: their tokenizer, as they report it
            self.model_dir = await self._connect(self.cfg.workers[0]).tokenizer_dir()
        await asyncio.to_thread(self._load_template, self.model_dir)
        self.replicas = Replicas(self.cfg.name, self.session, self._argv, self._healthy, self._alive,
                                 self._restore_replica, repair=self.repair, launched=launched,
                                 attached=list(self.cfg.workers), tokenizer=self.model_dir,
                                 startup_timeout_s=self.cfg.startup_timeout_s, router_args=self.cfg.router_args,
                                 env=self._env())
        self.replicas.start()

    async def _attach(self, url: str) -> None:
        self.client = self._connect(url)
        while not await self.client.healthy():
            self._state = "starting"
            await asyncio.sleep(2)
        if self.model_dir is None:
            self.model_dir = await self.client.tokenizer_dir()
        await asyncio.to_thread(self._load_template, self.model_dir)
        self._state = "ready"
        failures = 0  # reefd did not launch it, so it cannot restart it: it only reports it
        while True:
            await asyncio.sleep(Supervisor.HEALTH_INTERVAL_S)
            failures = 0 if await self.client.alive() else failures + 1
            state = "unreachable" if failures >= 3 else "ready"
            if state != self._state:
                log.warning("%s: attached engine at %s is %s", self.cfg.name, url, state)
                self._state = state

    def _load_template(self, model_dir: Path) -> None:
        """The tokenizer and chat template, and the context length the prompts must fit."""
        self.template = ChatTemplate(model_dir)
        if self.cfg.context_length is None:
            with contextlib.suppress(OSError, ValueError):
                config = json.loads((model_dir / "config.json").read_text())
                self.context_length = config.get("max_position_embeddings")

    async def _prepare(self, source: str) -> Path:
        out = self.state_dir / "models" / source
        if await asyncio.to_thread(is_complete, out, source):  # prepared before: no subprocess to start
            return out
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "reefd.worker.prepare", source, "--out", str(out), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            code = await proc.wait()
        finally:
            if proc.returncode is None:  # reefd is stopping: the preparation stops with it
                proc.terminate()
                await proc.wait()
        if code != 0:
            raise RuntimeError(f"preparing model {source!r} failed (exit {code})")
        return out

    def _argv(self, port: int) -> list[str]:
        assert self.model_dir is not None
        if self.cfg.engine == "sglang":
            return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                    "--host", "127.0.0.1", "--port", str(port), *INCREMENTAL, *self.cfg.launch_args]
        threads: list[str] = []
        if self.cfg.replicas > 1 and "--threads" not in self.cfg.launch_args:
            # replicas launched on one machine share its cores: more torch threads than cores stall them all
            threads = ["--threads", str(max(1, (os.cpu_count() or 1) // self.cfg.replicas))]
        return [sys.executable, "-m", "reefd.worker", "--model", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--max-batch", str(self.cfg.max_batch), *threads, *INCREMENTAL,
                *self.cfg.launch_args]

    def _env(self) -> dict[str, str] | None:
        """What a launched engine process gets beside reefd's own environment."""
        return None

    async def _restore_replica(self, url: str, joined: Callable[[], None]) -> None:
        """A replica's adapters, and its place among the replicas that admin calls reach, in one step: an adapter
        loaded meanwhile either comes with the restore or is broadcast to it."""
        async with self._admin:
            staged = await self._restore(url)
            joined()
            if staged is not None:  # one of the group serving weights on trial: back into it, out of the router
                staged.state = "trial"

    async def _restore(self, url: str) -> Replica | None:
        """A fresh process has the launch weights and no adapters: give it the weights and the adapters this
        engine serves before it takes requests (an attached engine that kept running may have them already;
        those are not loaded twice); the staged ones to a replica of the group serving weights on trial (then
        returned)."""
        client = self._connect(url)
        have: set[str] = set()
        info: dict[str, Any] = {}
        replica = None if self.replicas is None else next((r for r in self.replicas.replicas if r.url == url), None)
        staged = self.staged if replica is not None and replica.index in self.staged_on else None
        weights, adapters = (staged, self.staged_adapters) if staged is not None else (self.weights, self.adapters)
        if self.replicas is not None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                info = await client.server_info()
                have = set(info.get("loaded_adapters") or ())
        if weights.version is not None and launch_or(info.get("weight_version")) != weights.version:
            await client.update_weights_from_disk(self._weights_path(weights), weights.version)
            log.info("%s: restored weights %s", self.cfg.name, weights.version)
        if replica is not None:
            replica.weights = weights.version
        for name, path in list(adapters.items()):
            if name in have:
                continue
            await client.load_lora_adapter(name, path)
            log.info("%s: restored adapter %s", self.cfg.name, name)
        await self._prove(client, weights.version, [None, *adapters])  # else it restarts again
        return replica if staged is not None else None

    async def repair(self) -> list[str]:
        """A reconcile pass over the replicas: each serving replica's weight version and loaded adapters against
        what this engine serves. Other weights are replaced, a missing adapter is loaded and one no longer served
        is unloaded; returns what was repaired. What a replica does not report is left alone."""
        if self.replicas is None:
            return []
        done: list[str] = []
        async with self._admin:
            for url in self.replicas.urls():
                client = self._connect(url)
                try:
                    info = await client.server_info()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
                if "weight_version" in info and launch_or(info["weight_version"]) != self.weights.version:
                    await client.update_weights_from_disk(self._weights_path(self.weights), self.weights.version)
                    done.append(f"{url}: weights {info['weight_version']} -> {self.weights.version}")
                found = info.get("loaded_adapters")
                if not isinstance(found, dict | list):
                    continue
                loaded = set(found)
                for name, path in self.adapters.items():
                    if name not in loaded:
                        await client.load_lora_adapter(name, path)
                        done.append(f"{url}: loaded {name}")
                for name in sorted(set(loaded) - set(self.adapters)):
                    await client.unload_lora_adapter(name)
                    done.append(f"{url}: unloaded {name}")
                if done and done[-1].startswith(url):
                    try:
                        await self._prove(client, self.weights.version, [None, *self.adapters])
                    except EngineError as exc:  # a repaired replica that serves otherwise leaves the router
                        self._kill(url, f"repair did not take: {exc}")
                        done.append(f"{url}: restarted ({exc})")
        for line in done:
            log.warning("%s: repaired replica %s", self.cfg.name, line)
        self.repairs += len(done)
        return done

    async def _healthy(self, url: str) -> bool:
        return await self._connect(url).healthy()

    async def _alive(self, url: str) -> bool:
        return await self._connect(url).alive()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.replicas is not None:
            await self.replicas.stop()
        self._state = "stopped"

    async def sample_tokens(self, req: TokenSample, *, timeout_s: float = 600.0) -> TokenSamples:
        """SamplesTokens (token_sampling.py): on the one process, or straight on a replica serving the current
        weights (sglang-router would take vLLM's prompt only as text)."""
        return await token_sampling.sample(req, self.adapters, self.context_length, self._admission,
                                           lambda: self._route(self.weights.version, {-1}), timeout_s)

    def model_folder(self) -> Path | None:
        return self.model_dir

    def describe(self) -> dict[str, Any]:
        proc = self.supervisor if self.replicas is None else self.replicas.router  # the router, before replicas
        url = proc.url if proc else (self.cfg.url or "")
        out: dict[str, Any] = {
            "kind": self.kind, "state": self.state, "weights": self.weights.version, "last_swap": self.last_swap,
            "url": url if self.replicas is None else self.replicas.router_url,
            "restarts": proc.restarts if proc else 0, "pid": proc.pid if proc else None,
            "model_dir": str(self.model_dir) if self.model_dir else None, "context_length": self.context_length,
            "adapters": sorted(self.adapters), "last_error": proc.last_error if proc else None,
            "last_proof": self.last_proof, "staged": self.staged.version if self.staged is not None else None}
        if self.replicas is not None:
            out.update(replicas=self.replicas.describe(), repairs=self.repairs)
        return out

    async def replica_status(self) -> list[dict[str, Any]] | None:
        """Each replica: its state, the router's health and load for it, and the adapters it has loaded."""
        if self.replicas is None:
            return None
        listed = await self.replicas.workers()

        async def info(replica: dict[str, Any]) -> dict[str, Any]:
            if replica["state"] == "ready":
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    return await self._connect(replica["url"]).server_info(timeout_s=5)
            return {}

        replicas = self.replicas.describe()
        infos = await asyncio.gather(*(info(r) for r in replicas))  # one hung replica costs 5 s, not 5 s each
        out = []
        for replica, found in zip(replicas, infos, strict=True):
            seen = listed.get(replica["url"]) or {}
            out.append({**replica, "healthy": seen.get("is_healthy"), "load": seen.get("load"),
                        "adapters": sorted(found.get("loaded_adapters") or {}),
                        "requests": (found.get("stats") or {}).get("requests_completed")})
        return out


class WorkerEngine(SGLangEngine):
    """`engine: worker`: the same engine, with the worker kind's config (it launches `reefd.worker`)."""

    Config = WorkerConfig
    attaches = False
