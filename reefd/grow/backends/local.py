"""Where weight jobs run (`recipe.backend`): the TrainerBackend plug point, and `local`, which keeps
`python -m reefd.train --serve` processes warm between jobs.

A trainer process imports torch, transformers and peft once (seconds of CPU) and then runs job after
job, one spec path per line on its stdin; each job's JSON-lines events end with
`{"event": "exit", "status": N}`. A process that dies (a crash, a kill on timeout) is simply
replaced by the next job. Idle processes are kept (at most max_jobs) and stopped with reefd.
Knows the trainer's stdin/stdout protocol; nothing about recipes or the chain. Torch-free: the daemon's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from reefd import plugins
from reefd.engines.supervisor import die_with_parent

log = logging.getLogger("reefd.train")

Event = dict[str, Any]
CLUSTER_BACKENDS = ("ray", "slime")  # built with the scenario's cluster settings (recipe.ray_*, recipe.slime)


class TrainerTimeout(Exception):
    pass


class TrainerBackend(Protocol):
    """Where weight jobs run (`recipe.backend`: local, or pkg.mod:Class). reefd builds one per backend name as
    `Class(work_dir, max_jobs)`: a folder of its own under STATE/jobs, and how many jobs may run at once.

    Guarantees a backend gives reefd: `run` gets a spec file in the reefd.train format (reefd/train/spec.py),
    relays the trainer's JSON events to `on_event` as they come, and returns the exit status
    `python -m reefd.train --spec` would give (0 means the candidate is in the spec's output_dir, complete);
    TrainerTimeout past `timeout_s`, with the job stopped. `close` stops what the backend started. A `ray` or
    `slime` backend submits the same spec as a cluster job and relays its event lines, with no change to recipes
    or the runner.

    A backend whose jobs outlive reefd sets `detachable = True` and has `async stop(spec)`, which stops that job
    wherever it runs (a cancel); the others stop their jobs when the task running `run` is cancelled."""

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int: ...

    async def close(self) -> None: ...

    def prewarm(self) -> None:
        """A hint that weight jobs are coming (a scenario trains weights): get ready now if that helps."""


class Backends:
    """The trainer backends in use, one per name, each built on first use."""

    def __init__(self, work_dir: Path, max_jobs: int) -> None:
        self.work_dir, self.max_jobs = work_dir, max_jobs
        self._built: dict[str, TrainerBackend] = {}

    def of(self, recipe: Any) -> TrainerBackend:
        """The backend a scenario's `recipe` config names (a cluster backend: one per cluster and settings)."""
        cluster = None
        if recipe.backend in CLUSTER_BACKENDS:
            cluster = {"address": recipe.ray_address, "resources": recipe.ray_resources,
                       **({"slime": recipe.slime} if recipe.backend == "slime" else {})}
        return self.get(recipe.backend, cluster)

    def get(self, name: str, cluster: dict[str, Any] | None = None) -> TrainerBackend:
        """PluginError when `name` names no importable TrainerBackend (a scenario's load checks it first).
        `cluster`: a cluster backend's settings (`Class(work_dir, max_jobs, **cluster)`)."""
        key = name if cluster is None else f"{name}@{json.dumps(cluster, sort_keys=True, default=str)}"
        if key not in self._built:
            cls = plugins.resolve(plugins.BACKENDS, name, "trainer backend")
            missing = plugins.missing(TrainerBackend, cls)
            if missing:
                raise plugins.PluginError(f"trainer backend {name!r} is not a TrainerBackend (no {missing[0]})")
            folder = self.work_dir if name in plugins.BACKENDS else self.work_dir / "backends" / name
            self._built[key] = cls(folder, self.max_jobs, **(cluster or {}))
        return self._built[key]

    def prewarm(self, names: Iterable[str]) -> None:
        """Get these backends ready ahead of their first job (a name that cannot be loaded is logged)."""
        for name in sorted(set(names) - set(CLUSTER_BACKENDS)):  # a cluster starts each job's process itself
            try:
                self.get(name).prewarm()
            except plugins.PluginError as exc:
                log.warning("cannot prepare trainer backend %s: %s", name, exc)

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self._built.values()), return_exceptions=True)


class LocalTrainers:
    """`local`: trainer subprocesses of this machine; their stderr goes to WORK_DIR/trainer.log.

    A job is stopped (its timeout, a cancel, reefd stopping) as a Ray cluster stops one: SIGTERM, and SIGKILL
    STOP_GRACE_S later; the trainer saves the steps it finished meanwhile."""

    STOP_GRACE_S = 3.0  # Ray's RAY_JOB_STOP_WAIT_TIME_S default

    def __init__(self, work_dir: Path, max_jobs: int = 1) -> None:
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
            raise TrainerTimeout(f"the trainer ran past the job timeout ({timeout_s:.0f} s); it was stopped"
                                 ) from None
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
