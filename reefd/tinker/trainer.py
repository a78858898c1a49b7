"""A Tinker model's trainer: one `python -m reefd.train.session` process on this machine, holding the model, its
LoRA and its optimizer in memory, asked one request at a time (reefd/train/session.py has the protocol). Its
stderr goes to WORK_DIR/trainer.log. Torch-free: the process imports torch, reefd does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from reefd.engines.launch import die_with_parent

log = logging.getLogger("reefd.tinker")


class TrainerFailed(Exception):
    """The trainer could not do a request; `user` when the request was at fault (its message says why)."""

    def __init__(self, message: str, user: bool) -> None:
        super().__init__(message)
        self.user = user


class SessionTrainer:
    STOP_GRACE_S = 3.0

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def start(self, init: dict[str, Any]) -> dict[str, Any]:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with (self.work_dir / "trainer.log").open("ab") as stderr:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "reefd.train.session", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, preexec_fn=die_with_parent, limit=1 << 26)
        log.info("started Tinker trainer %d (its log: %s)", self._proc.pid, self.work_dir / "trainer.log")
        return await self.call({"op": "init", **init})

    async def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """The trainer's answer to `req`; TrainerFailed when it refused or failed it, or is gone."""
        async with self._lock:
            proc = self._proc
            if proc is None or proc.returncode is not None:
                raise TrainerFailed("the model's trainer is not running (it stopped or never started); "
                                    "create the model again, from a saved state if there is one", user=False)
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(req).encode() + b"\n")
                await proc.stdin.drain()
                line = await proc.stdout.readline()
            except (BrokenPipeError, ConnectionResetError):
                line = b""
            if not line:
                status = await proc.wait()
                raise TrainerFailed(f"the model's trainer exited ({status}); its log: "
                                    f"{self.work_dir / 'trainer.log'}", user=False)
            reply = json.loads(line)
        if "error" in reply:
            raise TrainerFailed(str(reply["error"]), bool(reply.get("user")))
        return dict(reply["ok"])

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()  # the trainer's stdin ends: it exits after the request it is on
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), self.STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
