"""`recipe.backend: local`: `python -m reefd.train --serve` processes on this machine, kept warm between jobs (at most
max_jobs idle), one spec path per stdin line, each job's events ending with `{"event": "exit", "status": N}`.
Knows the trainer's stdin/stdout protocol; nothing about recipes or the chain. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reefd.engines.launch import die_with_parent
from reefd.grow.backends import Event, TrainerTimeout

log = logging.getLogger("reefd.train")


@dataclass
class LocalConfig:
    """local: no settings (how many jobs run at once is reefd's --max-jobs)."""


class LocalTrainers:
    """Trainer subprocesses, their stderr in WORK_DIR/trainer.log. A job is stopped (its timeout, a cancel, reefd
    stopping) as Ray stops one: SIGTERM, SIGKILL STOP_GRACE_S later; the trainer saves the steps it finished."""

    Config = LocalConfig
    detachable = full_weights = pushes = False
    STOP_GRACE_S = 3.0  # Ray's RAY_JOB_STOP_WAIT_TIME_S default

    def __init__(self, work_dir: Path, max_jobs: int = 1, cfg: LocalConfig | None = None) -> None:
        self.log_path = work_dir / "trainer.log"
        self.keep = max_jobs
        self._idle: list[asyncio.subprocess.Process] = []
        self._busy = 0  # jobs running now
        self._warming: asyncio.Task[None] | None = None

    def prewarm(self) -> None:
        """Start a trainer process now, in the background, so that the first job does not wait for its imports
        (torch, transformers, peft: seconds of CPU). No-op while one is idle, starting, or running a job (that
        one stays warm, with the optimizer state it carries)."""
        if self._idle or self._busy or self.keep < 1 or (self._warming is not None and not self._warming.done()):
            return

        async def warm() -> None:
            try:
                proc = await self._spawn()
            except Exception as exc:  # OSError, SubprocessError: the next job starts its own and says why
                log.warning("cannot start a trainer process: %s", exc)
                return
            if len(self._idle) < self.keep:
                self._idle.append(proc)
            else:
                await _stop(proc)

        self._warming = asyncio.create_task(warm(), name="trainer-prewarm")

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "reefd.train", "--serve", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, preexec_fn=die_with_parent, limit=1 << 24)
        log.info("started trainer process %d (its log: %s)", proc.pid, self.log_path)
        return proc

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int:
        """Run one job; every event goes to `on_event`; returns the job's exit status (what `--spec` exits with).

        TrainerTimeout if it runs past `timeout_s` (its process is killed)."""
        if self._warming is not None:  # a process being started: this job takes it
            await asyncio.shield(self._warming)
        self._busy += 1
        try:
            return await self._run(spec, on_event, timeout_s)
        finally:
            self._busy -= 1

    async def _run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int:
        proc = None
        while self._idle and proc is None:
            candidate = self._idle.pop()
            if candidate.returncode is None:
                proc = candidate
        if proc is not None:
            status, heard = await self._job(proc, spec, on_event, timeout_s)
            if heard:
                return status
            log.info("a warm trainer had exited (%s); starting a fresh one", status)  # died while idle
        status, _ = await self._job(await self._spawn(), spec, on_event, timeout_s)
        return status

    async def _job(self, proc: asyncio.subprocess.Process, spec: Path, on_event: Callable[[Event], None],
                   timeout_s: float) -> tuple[int, bool]:
        """(exit status, whether the process said anything about this job)."""
        assert proc.stdin is not None and proc.stdout is not None
        status: int | None = None
        heard = False
        try:
            proc.stdin.write(f"{spec}\n".encode())
            await proc.stdin.drain()
            async with asyncio.timeout(timeout_s):
                status, heard = await _relay(proc, on_event)
                if status is None:  # the process died mid-job
                    status = await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # the trainer saves the steps it finished, then exits
            with contextlib.suppress(TimeoutError):  # what it says meanwhile, until it exits
                async with asyncio.timeout(self.STOP_GRACE_S):
                    await _relay(proc, on_event)
            raise TrainerTimeout(f"the trainer ran past the job timeout ({timeout_s:.0f} s); it was stopped") from None
        except (BrokenPipeError, ConnectionResetError):
            status = await proc.wait()
        finally:
            if status is not None and proc.returncode is None and status != 143:
                self._idle.append(proc)  # warm for the next job, which takes the most recent first
                while len(self._idle) > self.keep:  # the oldest idle one goes: this one carries optimizer state
                    await _stop(self._idle.pop(0))
            elif proc.returncode is None:
                await asyncio.shield(_stop(proc, self.STOP_GRACE_S))  # a cancel: it saves, as above
        return status, heard

    async def close(self) -> None:
        if self._warming is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._warming)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(_stop(p) for p in idle), return_exceptions=True)


async def _stop(proc: asyncio.subprocess.Process, grace_s: float = 0.0) -> None:
    """End a trainer process: SIGTERM first when it has `grace_s` to save its work, then SIGKILL."""
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


async def _relay(proc: asyncio.subprocess.Process, on_event: Callable[[Event], None]) -> tuple[int | None, bool]:
    """Relay one job's events until its exit line: (the status that line names, None when the process ended
    first; whether it said anything)."""
    assert proc.stdout is not None
    heard = False
    async for line in proc.stdout:
        event = _event(line)
        heard = heard or bool(event)
        if event.get("event") == "exit":
            return int(event.get("status", 1)), True
        if event:
            on_event(event)
    return None, heard


def _event(line: bytes) -> Event:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}
