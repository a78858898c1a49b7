"""Engines that speak SGLang's HTTP contract: the embedded worker and a real SGLang server.

Token in, token out: the prompt is rendered and tokenized here, `/generate` returns ids and
logprobs, and those exact numbers are what the record keeps. The same client drives
`python -m reefd.worker` and `python -m sglang.launch_server`. Knows nothing about
provider wire formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from reefd.engines import (
    ANY_WEIGHTS,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    ModelConfig,
    Prompt,
    retry_after,
    sse,
)
from reefd.engines.replicas import ROUTING_HEADER, Replica, Replicas
from reefd.engines.stream import StreamGuard
from reefd.engines.supervisor import Supervisor, die_with_parent
from reefd.serve.chat import ChatRequest, ChatTemplate, Completion, PromptTooLong, TemplateError, parse_tool_calls
from reefd.worker.prepare import is_complete

log = logging.getLogger("reefd.engine")


class SGLangClient:
    """The HTTP contract: /generate (plain or streamed), /health_generate, /get_model_info."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session = session
        self.base_url = base_url.rstrip("/")

    async def alive(self, timeout_s: float = 10.0) -> bool:
        """The server answers at all (`/health`), even while every batch slot is busy."""
        return await self._ok("/health", timeout_s)

    async def healthy(self, timeout_s: float = 30.0) -> bool:
        """The server generates a token (`/health_generate`)."""
        return await self._ok("/health_generate", timeout_s)

    async def _ok(self, path: str, timeout_s: float) -> bool:
        try:
            async with self.session.get(f"{self.base_url}{path}",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def load_lora_adapter(self, name: str, path: Path, timeout_s: float = 300.0) -> None:
        await self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout_s)

    async def unload_lora_adapter(self, name: str, timeout_s: float = 900.0) -> None:
        await self._lora("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def _lora(self, path: str, body: dict[str, Any], timeout_s: float) -> None:
        """SGLang's LoRAUpdateOutput: {success, error_message, loaded_adapters}; failures raise EngineError."""
        await self._admin_call(path, body, timeout_s, "error_message")

    async def _admin_call(self, path: str, body: dict[str, Any], timeout_s: float, message_key: str) -> None:
        """An SGLang admin route answering {success, <message_key>, ...}: failures raise EngineError (the server
        answered) or EngineUnavailable (it did not)."""
        try:
            async with self.session.post(f"{self.base_url}{path}", json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine unreachable for {path}: {exc}", retry_after=2) from exc
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = {}
        if r.status != 200 or not isinstance(answer, dict) or not answer.get("success"):
            message = answer.get(message_key) if isinstance(answer, dict) else None
            raise EngineError(f"{path} failed ({r.status}): {message or raw[:300].decode(errors='replace')}",
                              status=400 if 400 <= r.status < 500 else 502)

    async def update_weights_from_disk(self, path: Path, version: str | None, timeout_s: float = 900.0) -> None:
        """SGLang's UpdateWeightFromDiskReqInput: the server waits for its running requests, then loads `path`;
        `weight_version` names the weights in every answer's meta_info afterwards. Failures raise EngineError and
        leave the old weights serving."""
        body = {"model_path": str(path), "abort_all_requests": False, "weight_version": version or LAUNCH_VERSION}
        await self._admin_call("/update_weights_from_disk", body, timeout_s, "message")

    async def weight_version(self) -> tuple[bool, str | None]:
        """(reported, version): the server's weight version (`/get_weight_version`, else its server info), with
        SGLang's name for the weights it launched with read as None."""
        for path, key in (("/get_weight_version", "weight_version"), ("/get_server_info", "weight_version")):
            async with self.session.get(f"{self.base_url}{path}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    continue
                info = orjson.loads(await r.read())
            if isinstance(info, dict) and key in info:
                return True, launch_or(info[key])
        return False, None

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float = 600.0) -> None:
        """SGLang's InitWeightsUpdateGroupReqInput: join the trainer's group as rank `rank_offset` (blocks until
        the whole group has joined)."""
        await self._admin_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout_s, "message")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: str | None, group_name: str,
                                              timeout_s: float = 900.0) -> None:
        """SGLang's UpdateWeightsFromDistributedReqInput: receive the named tensors as the trainer (rank 0)
        broadcasts them, then serve them as `version`."""
        await self._admin_call("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True,
            "abort_all_requests": False, "weight_version": version or LAUNCH_VERSION}, timeout_s, "message")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._admin_call("/destroy_weights_update_group", {"group_name": group_name}, 60.0, "message")

    async def server_info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        async with self.session.get(f"{self.base_url}/get_server_info",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            info = orjson.loads(await r.read())
        return info if isinstance(info, dict) else {}

    async def loaded_adapters(self) -> set[str] | None:
        """The adapters the server reports loaded (`/get_server_info`), or None when it does not say."""
        async with self.session.get(f"{self.base_url}/get_server_info",
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
            info = orjson.loads(await r.read())
        found = info.get("loaded_adapters") if isinstance(info, dict) else None
        return set(found) if isinstance(found, dict | list) else None

    async def model_info(self) -> dict[str, Any]:
        async with self.session.get(f"{self.base_url}/get_model_info") as r:
            r.raise_for_status()
            return dict(orjson.loads(await r.read()))

    async def generate(self, payload: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        """Yields the engine's answer chunks (one when not streaming)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        answered = False
        try:
            async with self.session.post(f"{self.base_url}/generate", json=payload, headers=headers,
                                         timeout=timeout) as r:
                answered = True
                if r.status in (429, 503):  # busy or draining: the caller may retry
                    raise EngineUnavailable(f"engine answered {r.status}: "
                                            f"{(await r.text())[:500]}",
                                            retry_after=retry_after(r.headers.get("Retry-After")))
                if r.status != 200:
                    raise EngineError(f"engine answered {r.status}: {(await r.text())[:500]}",
                                      status=502 if r.status >= 500 else 400)
                if not payload.get("stream"):
                    yield dict(orjson.loads(await r.read()))
                    return
                async for data in sse.data_lines(r.content):
                    if data == b"[DONE]":
                        return
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        raise EngineError(f"engine error: {chunk['error']}")
                    yield chunk
                # a stream that stops without its [DONE] was cut (a replica died behind the router): not an answer
                raise EngineError("the engine's stream ended before its last event (the engine may have died)")
        except aiohttp.ClientConnectionError as exc:
            if not answered:  # the process is gone or restarting: the request never started
                raise EngineUnavailable(f"engine unreachable: {exc}", retry_after=2) from exc
            raise EngineError(f"engine connection lost: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(f"engine connection failed: {exc}") from exc
        except TimeoutError as exc:
            raise EngineError(f"engine did not answer within {timeout_s:.0f} s", status=504) from exc
        except (aiohttp.http_exceptions.HttpProcessingError, ValueError) as exc:  # a malformed answer
            raise EngineError(f"the engine's answer could not be read: {exc}") from exc


def top_k_rows(top: list[Any], tokens: int, k: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """SGLang's `output_top_logprobs` (per token, K `[logprob, token_id, text]`) as ids and logprobs, or None when
    the capture is partial: a token without its row, a row short of K, or an entry that is not one."""
    if len(top) != tokens:
        return None
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for row in top:
        if not isinstance(row, list) or len(row) < k:
            return None
        try:
            pairs = [(int(entry[1]), float(entry[0])) for entry in row[:k]]
        except (TypeError, ValueError, IndexError):
            return None
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps


def sampling_params(req: ChatRequest) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": req.max_tokens,
                              "temperature": 1.0 if req.temperature is None else req.temperature,
                              "top_p": 1.0 if req.top_p is None else req.top_p,
                              "top_k": -1 if req.top_k is None else req.top_k}
    if req.stop:
        params["stop"] = list(req.stop)
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.ignore_eos:
        params["ignore_eos"] = True
    return params


INCREMENTAL = ["--incremental-streaming-output"]
"""Launched engines stream only what is new on each event: SGLang's default repeats the whole answer so far, which
makes a long answer cost quadratic bytes and time. Attached servers may stream either way; both are read."""
LAUNCH_VERSION = "default"  # SGLang's weight_version for the weights a server launched with


def only(adapter: tuple[str, Path] | None) -> dict[str, Path]:
    return {adapter[0]: adapter[1]} if adapter is not None else {}


def launch_or(version: Any) -> str | None:
    """A reported weight version, with the launch weights' ("default", or none at all) as None."""
    return None if version in (None, LAUNCH_VERSION) else str(version)


@dataclass(frozen=True)
class Weights:
    """The weights an engine serves to new requests."""

    version: str | None = None  # the release id they were swapped in as (None: the weights it launched with)
    path: Path | None = None  # their folder (None: the model folder it launched with)


Drained = Callable[[str | None], Awaitable[None]]
"""drained(version): returns once no request taken on that weight version is in flight (reefd's own count)."""


class SGLangEngine:
    """`engine: worker` (launched `reefd.worker`) or `engine: sglang` (launched or attached)."""

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
        self._admission = asyncio.Event()  # cleared while one engine process loads new weights: new requests wait
        self._admission.set()
        self.last_swap: dict[str, Any] | None = None  # the last weights swap: when, how long, how long requests held
        self._group: tuple[str, list[str]] | None = None  # a trainer's weight update group: its name, its processes

    # ------------------------------------------------------------ lifecycle

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

    async def start(self) -> None:
        self._task = asyncio.create_task(self._start(), name=f"engine-{self.cfg.name}")

    async def _start(self) -> None:
        try:
            if self.cfg.replicas > 1 or self.cfg.workers:
                await self._start_replicas()
                return
            if self.cfg.engine == "sglang" and self.cfg.url:
                await self._attach(self.cfg.url)
                return
            if self.model_dir is None:
                assert self.cfg.source is not None
                self.model_dir = await self._prepare(self.cfg.source)
            await asyncio.to_thread(self._load_template, self.model_dir)  # reads the tokenizer: off the loop
            self.supervisor = Supervisor(
                self.cfg.name, self._argv, self._healthy, alive=self._alive, on_launch=self._restore,
                startup_timeout_s=self.cfg.startup_timeout_s)
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
            info = await SGLangClient(self.session, self.cfg.workers[0]).model_info()
            self.model_dir = Path(info.get("tokenizer_path") or info["model_path"])
        await asyncio.to_thread(self._load_template, self.model_dir)
        self.replicas = Replicas(self.cfg.name, self.session, self._argv, self._healthy, self._alive,
                                 self._restore_replica,
                                 repair=self.repair,
                                 launched=launched, attached=list(self.cfg.workers), tokenizer=self.model_dir,
                                 startup_timeout_s=self.cfg.startup_timeout_s, router_args=self.cfg.router_args)
        self.replicas.start()

    async def _attach(self, url: str) -> None:
        self.client = SGLangClient(self.session, url)
        while not await self.client.healthy():
            self._state = "starting"
            await asyncio.sleep(2)
        if self.model_dir is None:
            info = await self.client.model_info()
            self.model_dir = Path(info.get("tokenizer_path") or info["model_path"])
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
            sys.executable, "-m", "reefd.worker.prepare", source, "--out", str(out),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            preexec_fn=die_with_parent)
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
            return [sys.executable, "-m", "sglang.launch_server", "--model-path",
                    str(self.model_dir), "--host", "127.0.0.1", "--port", str(port),
                    *INCREMENTAL, *self.cfg.launch_args]
        threads: list[str] = []
        if self.cfg.replicas > 1 and "--threads" not in self.cfg.launch_args:
            # replicas launched on one machine share its cores: more torch threads than cores stall them all
            threads = ["--threads", str(max(1, (os.cpu_count() or 1) // self.cfg.replicas))]
        return [sys.executable, "-m", "reefd.worker", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(port),
                "--max-batch", str(self.cfg.max_batch), *threads, *INCREMENTAL, *self.cfg.launch_args]

    async def _restore_replica(self, url: str, joined: Callable[[], None]) -> None:
        """A replica's adapters, and its place among the replicas that admin calls reach, in one step: an adapter
        loaded meanwhile either comes with the restore or is broadcast to it."""
        async with self._admin:
            await self._restore(url)
            joined()

    async def _restore(self, url: str) -> None:
        """A fresh process has the launch weights and no adapters: give it the weights and the adapters this
        engine serves before it takes requests (an attached engine that kept running may have them already;
        those are not loaded twice)."""
        client = SGLangClient(self.session, url)
        have: set[str] = set()
        info: dict[str, Any] = {}
        if self.replicas is not None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                info = await client.server_info()
                have = set(info.get("loaded_adapters") or ())
        if self.weights.version is not None and launch_or(info.get("weight_version")) != self.weights.version:
            await client.update_weights_from_disk(self._weights_path(self.weights), self.weights.version)
            log.info("%s: restored weights %s", self.cfg.name, self.weights.version)
        if self.replicas is not None:
            for replica in self.replicas.replicas:
                if replica.url == url:
                    replica.weights = self.weights.version
        for name, path in list(self.adapters.items()):
            if name in have:
                continue
            await client.load_lora_adapter(name, path)
            log.info("%s: restored adapter %s", self.cfg.name, name)

    def _weights_path(self, weights: Weights) -> Path:
        path = weights.path or self.model_dir
        if path is None:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} has no model folder yet")
        return path

    async def load_adapter(self, name: str, path: Path) -> None:
        async with self._admin:
            await self._load_adapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        async with self._admin:
            await self._unload_adapter(name)

    # ------------------------------------------------------------ full weights

    async def admit(self) -> None:
        """Wait while new weights load into a single engine process (new requests are held, not refused)."""
        await self._admission.wait()

    @contextlib.asynccontextmanager
    async def _holding(self) -> AsyncIterator[Callable[[], float]]:
        """New requests wait (`admit`) for the block; yields a function giving the seconds held so far."""
        self._admission.clear()
        started = time.monotonic()
        try:
            yield lambda: round(time.monotonic() - started, 3)
        finally:
            self._admission.set()

    async def adopt_weights(self, path: Path | None = None) -> str | None:
        """Take the weights a trainer pushed to this engine's one process, not through reefd (slime's weight
        sync), as what it serves: their version as the server reports it (None when it reports none). `path`: the
        same weights on disk, for a process that restarts. Generation is resumed first (`/continue_generation`),
        in case the trainer stopped between its pause and its continue."""
        async with self._admin:
            client = self._client()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # a trainer that died while it was paused
                async with self.session.post(f"{client.base_url}/continue_generation", json={},
                                             timeout=aiohttp.ClientTimeout(total=30)):
                    pass
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
        serving and raises."""
        async with self._admin:
            self._client()  # not ready: EngineUnavailable
            started = time.monotonic()
            serving = [] if self.replicas is None else \
                [r for r in self.replicas.replicas if r.state == "ready" and r.worker_id is not None]
            if len(serving) < 2:  # one process, or one replica left serving: nothing to roll across
                report = await self._swap_held(path, version, adapter, switch, drained, serving)
            else:
                report = await self._roll(path, version, adapter, switch, drained, serving)
            report.update(version=version, total_s=round(time.monotonic() - started, 3), at=time.time())
            self.last_swap = report
            log.info("%s: now serving weights %s (%s)", self.cfg.name, version, report)
            return report

    async def _swap_held(self, path: Path | None, version: str, adapter: tuple[str, Path] | None,
                         switch: Callable[[], None], drained: Drained, serving: list[Replica]) -> dict[str, Any]:
        """New requests wait while the requests on the old weights finish and every serving process takes the new
        weights and adapter; on a failure each is put back on the old ones (or restarted)."""
        old, new, old_adapters = self.weights, Weights(version, path), dict(self.adapters)
        targets = [SGLangClient(self.session, r.url) for r in serving] if self.replicas is not None else \
            [self._client()]
        done: list[SGLangClient] = []
        async with self._holding() as held:
            await drained(old.version)
            try:
                for client in targets:
                    done.append(client)
                    await self._take(client, new, only(adapter))
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

    # ------------------------------------------------------------ weights from a trainer beside the engines

    def _weight_clients(self) -> list[SGLangClient]:
        """Every process serving now: each replica directly (the router 404s admin calls), or the one process."""
        if self.replicas is None:
            return [self._client()]
        return [SGLangClient(self.session, u) for u in self.replicas.urls()]

    def weight_group_size(self) -> int:
        """The world size of a weight update group with this engine: the trainer (rank 0) and every serving
        process (ranks 1..N)."""
        return 1 + len(self._weight_clients())

    async def join_weight_group(self, master_address: str, master_port: int, *,
                                group_name: str = "weight_update_group", backend: str = "nccl") -> int:
        """Every serving process joins the trainer's weight update group at once (`init_weights_update_group`;
        it returns when the trainer has joined too). Returns the world size."""
        async with self._admin:
            clients = self._weight_clients()
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
            clients = [SGLangClient(self.session, u) for u in urls]
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
                    await SGLangClient(self.session, url).destroy_weights_update_group(group)

    async def _take(self, client: SGLangClient, weights: Weights, adapters: dict[str, Path]) -> None:
        """One process: the weights, then `adapters` as its only adapters."""
        await client.update_weights_from_disk(self._weights_path(weights), weights.version)
        loaded = await client.loaded_adapters()
        for name in sorted(set(self.adapters) if loaded is None else loaded):  # None: the server does not say
            await client.unload_lora_adapter(name)
        for name, folder in adapters.items():
            await client.load_lora_adapter(name, folder)

    async def _put_back(self, client: SGLangClient, weights: Weights, adapters: dict[str, Path]) -> None:
        """After a failed swap: the old weights and adapters, or (when even that fails) a restart of the process,
        which comes back with them (`_restore`)."""
        try:
            await client.update_weights_from_disk(self._weights_path(weights), weights.version)
            have = await client.loaded_adapters() or set()
            for name in sorted(have - set(adapters)):
                await client.unload_lora_adapter(name)
            for name, folder in adapters.items():
                if name not in have:
                    await client.load_lora_adapter(name, folder)
        except Exception as exc:
            log.error("%s: %s could not be put back on weights %s (%s); restarting it", self.cfg.name,
                      client.base_url, weights.version, exc)
            self._kill(client.base_url, f"weights revert failed: {exc}")

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
        self.adapters = only(adapter)
        switch()
        switch_s = time.monotonic() - switched
        drain = time.monotonic()
        # requests taken on the old weights, sent to the draining replicas, finish; meanwhile the new weights and
        # adapter serve, so admin calls (a gate's adapter, a crashed replica's restore) need not wait for them
        self._admin.release()
        try:
            await drained(old.version)
        finally:
            await self._admin.acquire()
        drain_s = time.monotonic() - drain
        for replica in rest:
            if replica.state != "draining":  # it died meanwhile: its restart gives it the new weights
                continue
            replica.state = "updating"
            try:
                await self._update(replica, new, dict(self.adapters))  # with any adapter loaded since the switch
                await self.replicas.join(replica)
            except Exception as exc:  # restarted: a fresh process is given the new weights before it joins
                log.error("%s: replica %d did not take weights %s (%s); restarting it", self.cfg.name,
                          replica.index, version, exc)
                self._kill(replica.url, f"weights update failed: {exc}")
        return {"replicas": len(serving), "held_s": 0.0, "switch_s": round(switch_s, 3),
                "drain_s": round(drain_s, 3)}

    async def _update(self, replica: Replica, weights: Weights, adapters: dict[str, Path]) -> None:
        """One replica out of the router: its running requests finish, then the weights load, its adapters become
        `adapters`, and a generate checks it."""
        client = SGLangClient(self.session, replica.url)
        await self._idle(replica)
        await self._take(client, weights, adapters)
        replica.weights = weights.version
        if not await client.healthy():
            raise EngineError(f"replica {replica.index} does not generate after its weights update")
        reported, version = await client.weight_version()
        if reported and version != weights.version:
            raise EngineError(f"replica {replica.index} reports weights {version}, not {weights.version}")

    async def _revert(self, replica: Replica, weights: Weights, adapters: dict[str, Path]) -> None:
        """Put a replica back on the old weights and adapters after a failed swap (or restart it)."""
        assert self.replicas is not None
        await self._put_back(SGLangClient(self.session, replica.url), weights, adapters)
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
        client = SGLangClient(self.session, replica.url)
        while time.monotonic() < deadline:
            info = await client.server_info()
            if "running_requests" not in info or \
                    (replica.direct == 0 and not info.get("running_requests") and not info.get("waiting_requests")):
                return
            await asyncio.sleep(0.02)

    async def repair(self) -> list[str]:
        """A reconcile pass over the replicas: each serving replica's weight version and loaded adapters against
        what this engine serves. Other weights are replaced, a missing adapter is loaded and one no longer served
        is unloaded; returns what was repaired. What a replica does not report is left alone."""
        if self.replicas is None:
            return []
        done: list[str] = []
        async with self._admin:
            for url in self.replicas.urls():
                client = SGLangClient(self.session, url)
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
        for line in done:
            log.warning("%s: repaired replica %s", self.cfg.name, line)
        self.repairs += len(done)
        return done

    async def _load_adapter(self, name: str, path: Path) -> None:
        if name in self.adapters:
            raise EngineError(f"an adapter named {name!r} is already loaded", status=400)
        if self.replicas is not None:  # the router 404s admin calls: every replica, directly
            self._client()  # not ready: EngineUnavailable
            urls = self.replicas.urls()
            results = await asyncio.gather(*(SGLangClient(self.session, u).load_lora_adapter(name, path)
                                              for u in urls), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:  # all or none: take it off the replicas that loaded it
                for url, result in zip(urls, results, strict=True):
                    if not isinstance(result, BaseException):
                        with contextlib.suppress(EngineError, EngineUnavailable):
                            await SGLangClient(self.session, url).unload_lora_adapter(name)
                raise failed[0]
        else:
            await self._client().load_lora_adapter(name, path)
        self.adapters[name] = path

    async def _unload_adapter(self, name: str) -> None:
        path = self.adapters.pop(name, None)
        if path is None:
            raise EngineError(f"no adapter named {name!r} is loaded", status=400)
        if self.replicas is not None:
            results = await asyncio.gather(*(SGLangClient(self.session, u).unload_lora_adapter(name)
                                              for u in self.replicas.urls()), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                self.adapters[name] = path  # still loaded somewhere: keep track of it
                raise failed[0]
            return
        if self.ready:  # a restarting engine comes back without it anyway
            try:
                await self._client().unload_lora_adapter(name)
            except (EngineError, EngineUnavailable):
                self.adapters[name] = path  # still loaded there: keep track of it
                raise

    async def _healthy(self, url: str) -> bool:
        return await SGLangClient(self.session, url).healthy()

    async def _alive(self, url: str) -> bool:
        return await SGLangClient(self.session, url).alive()

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

    def model_folder(self) -> Path | None:
        return self.model_dir

    def describe(self) -> dict[str, Any]:
        sup = self.supervisor
        if self.replicas is not None:
            router = self.replicas.router
            return {"kind": self.kind, "state": self.state, "url": self.replicas.router_url,
                    "restarts": router.restarts if router else 0, "pid": router.pid if router else None,
                    "model_dir": str(self.model_dir) if self.model_dir else None,
                    "context_length": self.context_length, "adapters": sorted(self.adapters),
                    "last_error": router.last_error if router else None, "replicas": self.replicas.describe(),
                    "weights": self.weights.version, "last_swap": self.last_swap,
                    "repairs": self.repairs}
        return {"kind": self.kind, "state": self.state, "weights": self.weights.version, "last_swap": self.last_swap,
                "url": sup.url if sup else (self.cfg.url or ""),
                "restarts": sup.restarts if sup else 0, "pid": sup.pid if sup else None,
                "model_dir": str(self.model_dir) if self.model_dir else None,
                "context_length": self.context_length, "adapters": sorted(self.adapters),
                "last_error": sup.last_error if sup else None}

    async def replica_status(self) -> list[dict[str, Any]] | None:
        """Each replica: its state, the router's health and load for it, and the adapters it has loaded."""
        if self.replicas is None:
            return None
        listed = await self.replicas.workers()

        async def info(replica: dict[str, Any]) -> dict[str, Any]:
            if replica["state"] == "ready":
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with self.session.get(f"{replica['url']}/get_server_info",
                                                timeout=aiohttp.ClientTimeout(total=5)) as r:
                        return dict(orjson.loads(await r.read()))
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

    # ------------------------------------------------------------ generation

    def _client(self) -> SGLangClient:
        if not self.ready:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} is {self.state}; "
                                    "retry shortly", retry_after=2)
        if self.replicas is not None:  # generation goes through the router
            if self.client is None or self.client.base_url != self.replicas.router_url:
                self.client = SGLangClient(self.session, self.replicas.router_url)
            return self.client
        if self.supervisor is not None and (self.client is None or self.client.base_url != self.supervisor.url):
            self.client = SGLangClient(self.session, self.supervisor.url)
        assert self.client is not None
        return self.client

    def count_tokens(self, req: ChatRequest) -> int:
        """The prompt's tokens (blocking: call it off the event loop)."""
        if self.template is None:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r} is {self.state}")
        return len(self._prompt_ids(self.template, req))

    def _prompt_ids(self, template: ChatTemplate, req: ChatRequest) -> list[int]:
        """Render and tokenize (blocking); a prompt whose text cannot fit the context is refused untokenized."""
        try:
            return template.prompt_ids(req, self.context_length)
        except TemplateError as exc:
            raise EngineError(str(exc), status=400) from exc
        except PromptTooLong as exc:
            raise ContextLengthExceeded(exc.at_least, exc.limit, at_least=True) from exc

    def _route(self, weights: str | None, tried: set[int]) -> tuple[SGLangClient, Replica | None]:
        """Where a request on `weights` goes: the router (or the one process) while they are the serving weights,
        else straight to a replica that still has them (a request taken just before a rolling swap switched)."""
        client = self._client()
        if self.replicas is None or weights == ANY_WEIGHTS or (weights == self.weights.version and -1 not in tried):
            return client, None
        found = [r for r in self.replicas.replicas
                 if r.state in ("ready", "draining") and r.url and r.weights == weights and r.index not in tried]
        if not found:
            raise EngineUnavailable(f"engine for model {self.cfg.name!r}: the weights "
                                    f"{weights or 'it launched with'} no longer serve; retry", retry_after=1)
        replica = min(found, key=lambda r: r.direct)
        return SGLangClient(self.session, replica.url), replica

    async def _open(self, payload: dict[str, Any], timeout_s: float, routing_key: str | None,
                    weights: str | None) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]], Replica | None]:
        """The first chunk of the answer, the rest, and the replica it was sent to directly (if it was). An answer
        whose first chunk names other weights than `weights` (the router picked a replica that had just switched)
        is dropped and the request is sent again where those weights still serve."""
        tried: set[int] = set()
        while True:
            client, replica = self._route(weights, tried)
            headers = {ROUTING_HEADER: routing_key} if routing_key and replica is None and self.replicas else None
            if replica is not None:
                replica.direct += 1
            chunks = client.generate(payload, timeout_s, headers)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                if replica is not None:
                    replica.direct -= 1
                raise EngineError("the engine answered without any output") from None
            except BaseException:
                if replica is not None:
                    replica.direct -= 1
                await chunks.aclose()  # type: ignore[attr-defined]
                raise
            meta = first.get("meta_info") or {}
            if weights == ANY_WEIGHTS or "weight_version" not in meta or launch_or(meta["weight_version"]) == weights:
                return first, chunks, replica
            if self.replicas is None:  # one process: nowhere else to send it (a swap outlasted its drain wait)
                log.warning("%s: a request on weights %s was answered by weights %s", self.cfg.name, weights,
                            meta["weight_version"])
                return first, chunks, replica
            if replica is not None:
                replica.direct -= 1
            await chunks.aclose()  # type: ignore[attr-defined]
            log.info("%s: a request on weights %s reached weights %s; sent again", self.cfg.name, weights,
                     meta["weight_version"])
            tried.add(-1 if replica is None else replica.index)
            payload = {**payload, "rid": uuid.uuid4().hex}

    async def generate(self, req: ChatRequest, *, stream: bool = True, timeout_s: float = 600.0,
                       adapter: str | None = None, weights: str | None = ANY_WEIGHTS
                       ) -> AsyncIterator[Prompt | str | Completion]:
        self._client()  # not ready: EngineUnavailable
        assert self.template is not None
        # rendering and tokenizing a long prompt takes a while: off the event loop, which keeps serving others
        prompt_ids = await asyncio.to_thread(self._prompt_ids, self.template, req)
        limit = self.context_length
        params = sampling_params(req)
        if limit is not None:
            if len(prompt_ids) >= limit:
                raise ContextLengthExceeded(len(prompt_ids), limit)
            # the answer may use what the prompt leaves; it then ends with a length stop
            params["max_new_tokens"] = min(params["max_new_tokens"], limit - len(prompt_ids))
        payload = {"input_ids": prompt_ids, "sampling_params": params,
                   "return_logprob": True, "stream": stream, "rid": uuid.uuid4().hex}
        if adapter is not None:
            payload["lora_path"] = adapter  # SGLang: the name an adapter was loaded under
        if req.top_logprobs > 0:
            payload["top_logprobs_num"] = req.top_logprobs
        tools_on = bool(req.tools) and req.tool_choice != "none"
        first, chunks, replica = await self._open(payload, timeout_s, req.routing_key, weights)
        try:
            async for out in self._decode(first, chunks, prompt_ids, req, stream, tools_on):
                yield out
        finally:
            if replica is not None:
                replica.direct -= 1
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _decode(self, first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]], prompt_ids: list[int],
                      req: ChatRequest, stream: bool, tools_on: bool) -> AsyncIterator[Prompt | str | Completion]:
        guard = StreamGuard(req.stop, hold_tool_markup=tools_on)
        text = ""
        ids: list[int] = []
        logprobs: list[float | None] = []
        top: list[Any] = []
        meta: dict[str, Any] = {}
        yield Prompt(len(prompt_ids))

        async def every() -> AsyncIterator[dict[str, Any]]:
            yield first
            async for chunk in chunks:
                yield chunk

        async for chunk in every():
            meta = chunk.get("meta_info") or {}
            new_ids = chunk.get("output_ids") or []
            new_lps = meta.get("output_token_logprobs") or []
            new_top = meta.get("output_top_logprobs") or []
            chunk_text = chunk.get("text") or ""
            if len(new_ids) == meta.get("completion_tokens", -1):  # cumulative (SGLang default)
                new_ids, new_lps, new_top = new_ids[len(ids):], new_lps[len(logprobs):], new_top[len(top):]
                # the engine's text is the truth; a final text may drop a trimmed stop string
                delta = chunk_text[len(text):] if chunk_text.startswith(text) else ""
                text = chunk_text
            else:  # incremental chunks (SGLang --incremental-streaming-output)
                delta = chunk_text
                text += chunk_text
            ids.extend(new_ids)
            logprobs.extend(None if lp[0] is None else float(lp[0]) for lp in new_lps)
            top.extend(new_top)
            if delta and stream:
                out = guard.feed(delta)
                if out:
                    yield out
        completion = self._finish(text, ids, logprobs, meta, prompt_ids, req, tools_on)
        if req.top_logprobs > 0:
            captured = top_k_rows(top, len(ids), req.top_logprobs)
            completion.top_k_capture = "partial" if captured is None else "full"
            if captured is not None:
                completion.completion_top_ids, completion.completion_top_logprobs = captured
        if stream:
            tail = guard.tail(completion.text or "")
            if tail:
                yield tail
        yield completion

    def _finish(self, text: str, ids: list[int], logprobs: list[float | None], meta: dict[str, Any],
                prompt_ids: list[int], req: ChatRequest, tools_on: bool) -> Completion:
        reason = meta.get("finish_reason") or {}
        rtype = reason.get("type")
        if rtype == "abort":
            raise EngineError(f"engine aborted the request: {reason.get('message', '')}")
        matched = reason.get("matched")
        content, calls = parse_tool_calls(text) if tools_on else (text, [])
        finish = "tool_calls" if calls else ("length" if rtype == "length" else "stop")
        return Completion(
            text=content, finish_reason=finish, tool_calls=calls,
            stop_sequence=matched if isinstance(matched, str) and matched in req.stop else None,
            prompt_tokens=int(meta.get("prompt_tokens", len(prompt_ids))),
            completion_tokens=int(meta.get("completion_tokens", len(ids))),
            raw_text=text, prompt_token_ids=prompt_ids, completion_token_ids=ids,
            completion_logprobs=logprobs if len(logprobs) == len(ids) else None,
            weight_version=meta.get("weight_version"), weights_reported="weight_version" in meta)

