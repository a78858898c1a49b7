"""LoRA adapters on an SGLang-speaking engine: loaded and unloaded on every serving process at once (all or none),
directly, since the router 404s admin calls. Knows nothing about generating or full weights."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from reefd.engines import EngineError, EngineUnavailable
from reefd.engines.sglang_base import SGLangBase
from reefd.engines.sglang_client import SGLangClient


class Adapters(SGLangBase):
    """`load_adapter` and `unload_adapter`, one admin change at a time; a restarted process gets them back from
    `adapters` (SGLangEngine._restore)."""

    async def load_adapter(self, name: str, path: Path) -> None:
        async with self._admin:
            if name in self.adapters:
                raise EngineError(f"an adapter named {name!r} is already loaded", status=400)
            self._client()  # not ready: EngineUnavailable
            clients = self._processes()
            results = await asyncio.gather(*(self._load_proved(c, name, path) for c in clients),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:  # all or none: take it off the processes that loaded it
                for client, result in zip(clients, results, strict=True):
                    if not isinstance(result, BaseException):
                        with contextlib.suppress(EngineError, EngineUnavailable):
                            await client.unload_lora_adapter(name)
                raise failed[0]
            self.adapters[name] = path

    async def _load_proved(self, client: SGLangClient, name: str, path: Path) -> None:
        """Load on one process, then prove it (when the adapter's release has a fingerprint): a process that says
        it loaded the adapter but answers otherwise counts as failed, and it is taken off again."""
        await client.load_lora_adapter(name, path)
        try:
            await self._prove(client, self.weights.version, [None, name])  # base beside it: one batch
        except BaseException:
            with contextlib.suppress(EngineError, EngineUnavailable):
                await client.unload_lora_adapter(name)
            raise

    async def unload_adapter(self, name: str) -> None:
        async with self._admin:
            self.proofs = {key: fp for key, fp in self.proofs.items() if key[1] != name}
            path = self.adapters.pop(name, None)
            if path is None:
                raise EngineError(f"no adapter named {name!r} is loaded", status=400)
            if self.replicas is None and not self.ready:  # a restarting engine comes back without it anyway
                return
            results = await asyncio.gather(*(c.unload_lora_adapter(name) for c in self._processes()),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                self.adapters[name] = path  # still loaded somewhere: keep track of it
                raise failed[0]
