"""`recipe.backend: ray`: weight jobs as Ray jobs through a cluster's Jobs REST API (docs/engines.md), each running
`python -m reefd.train --spec` with its spec as the job's working_dir and relaying its event lines from the job's
logs. Knows the Jobs API and the trainer's events; never imports ray or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import shlex
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from reefd.grow.backends import Event, TrainerTimeout

log = logging.getLogger("reefd.train")
ROOT = Path(__file__).resolve().parents[3]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
ADDRESS_ENV = "REEF_RAY_ADDRESS"
RESOURCES = ("num_cpus", "num_gpus", "memory", "resources")  # Ray's entrypoint_* fields


@dataclass
class RayConfig:
    """ray: the cluster, and what each job's process needs on it."""

    kind: ClassVar[str] = "ray"
    address: str | None = field(default=None, metadata={
        "description": f"The cluster's dashboard (Ray Jobs API), e.g. http://127.0.0.1:8265; default: {ADDRESS_ENV}."})
    resources: dict[str, Any] = field(default_factory=dict, metadata={
        "description": "Ray's entrypoint resources: num_cpus, num_gpus, memory (bytes), resources ({name: amount})."})

    def __post_init__(self) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"recipe.backend: {self.kind} needs Ray, which is not installed: pip install 'reefd[ray]'")
        self.address = (self.address or os.environ.get(ADDRESS_ENV) or "").rstrip("/")
        if not self.address:
            raise ValueError(f"recipe.backend.address: backend {self.kind} needs a cluster address (or {ADDRESS_ENV})")
        for key, value in self.resources.items():
            if key not in RESOURCES:
                raise ValueError(f"recipe.backend.resources.{key}: not one of {', '.join(RESOURCES)}")
            ok = isinstance(value, dict) if key == "resources" else isinstance(value, int | float) and value >= 0
            if not ok or isinstance(value, bool):
                raise ValueError(f"recipe.backend.resources.{key}: {value!r} is not " + (
                    "a map of resource names to amounts" if key == "resources" else "a number >= 0"))


class RayUnavailable(Exception):
    """The cluster cannot be reached, refuses the token, or answers something that is not the Jobs API."""


def ray_token() -> str | None:
    """Ray's auth token from the environment, a file it names, or reefd's systemd credential."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"),
                 os.path.join(os.environ["CREDENTIALS_DIRECTORY"], "ray-token")
                 if os.environ.get("CREDENTIALS_DIRECTORY") else None):
        if path and os.path.isfile(path):
            return Path(path).read_text().strip()
    return None


class RayJobs:
    """Weight jobs on a Ray cluster (`Class(work_dir, max_jobs, RayConfig)`)."""

    Config: type[RayConfig] = RayConfig
    detachable = True  # a job outlives reefd: after a restart, `run` with the same spec follows it
    full_weights = pushes = False
    POLL_S = 0.5
    START_TIMEOUT_S = 300.0  # a job that never leaves PENDING (no resources, a dead cluster) fails after this
    STOP_WAIT_S = 10.0  # after `stop`: Ray's 3 s to SIGKILL, and the poll that sees the job end
    UNREACHABLE_S = 60.0  # a running job's cluster may fail to answer this long (a dashboard restart) before it fails
    SLOW_POLL_S = 2.0  # past the first minute, the job's state and log are read this often

    def __init__(self, work_dir: Path, max_jobs: int, cfg: RayConfig) -> None:
        self.work_dir, self.max_jobs = work_dir, max_jobs
        self.address, self.resources = str(cfg.address), dict(cfg.resources)
        self._session: aiohttp.ClientSession | None = None

    def prewarm(self) -> None:
        """Nothing to warm: the cluster starts each job's process itself."""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            token = ray_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    data: bytes | None = None) -> tuple[int, Any]:
        try:
            async with self._http().request(method, f"{self.address}{path}", json=body, data=data) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RayUnavailable(f"cannot reach the Ray cluster at {self.address}: {exc or type(exc).__name__}"
                                 ) from None
        if status in (401, 403):
            raise RayUnavailable(f"the Ray cluster at {self.address} refused reefd's token ({status}); set "
                                 "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or the ray-token credential")
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    @staticmethod
    def submission_id(spec: Path) -> str:
        """The Ray job of a spec: `reef-<the Reef job id>`."""
        return f"reef-{json.loads(Path(spec).read_text()).get('job') or Path(spec).parent.name}"

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int:
        """Submit (or find) the job, relay its event lines, return its exit status; TrainerTimeout past
        `timeout_s` (the job is stopped, and what it said while stopping is relayed). A cluster that cannot run
        it gives an error event and status 1."""
        submission = self.submission_id(spec)
        started = time.monotonic()
        try:
            await self._submit(submission, spec)
            return await self._follow(submission, on_event, started, started + timeout_s)
        except RayUnavailable as exc:
            on_event({"event": "error", "reason": str(exc)})
            return 1

    async def stop(self, spec: Path) -> str | None:
        """Stop the spec's Ray job (a cancel): SIGTERM, SIGKILL 3 s later. Returns once the cluster says it ended
        (None; also when there is no such job), or what went wrong. A job still pending stops the moment the cluster
        could start it (Ray queues the stop on its supervisor)."""
        try:
            submission = self.submission_id(spec)
        except (OSError, ValueError):
            return None  # no spec: it never reached the cluster
        try:
            status, _ = await self._call("POST", f"/api/jobs/{submission}/stop")
            if status == 404:
                return None
            deadline = time.monotonic() + self.STOP_WAIT_S
            while True:
                code, info = await self._call("GET", f"/api/jobs/{submission}")
                state = info.get("status") if isinstance(info, dict) else None
                if code == 404 or state in (*TERMINAL, "PENDING"):  # PENDING: stops the moment it could start
                    return None
                if time.monotonic() > deadline:
                    return f"the Ray job {submission} was still {state} {self.STOP_WAIT_S:.0f} s after its stop"
                await asyncio.sleep(self.POLL_S)
        except RayUnavailable as exc:
            return f"its Ray job {submission} may still run: {exc}"

    async def _submit(self, submission: str, spec: Path) -> None:
        status, found = await self._call("GET", f"/api/jobs/{submission}")
        if status == 200 and isinstance(found, dict):
            log.info("Ray job %s exists (%s): following it", submission, found.get("status"))
            return
        working_dir = await self._upload(spec)
        entrypoint = self.entrypoint(spec)
        # the trainer's own switches (REEF_TRAIN_*) travel with the job
        env = {k: v for k, v in os.environ.items() if k.startswith("REEF_TRAIN_")}
        # the objective a spec names imports as it would for reefd (from a checkout, or reefd's PYTHONPATH)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        status, answer = await self._call("POST", "/api/jobs/", {
            "entrypoint": entrypoint, "submission_id": submission,
            "runtime_env": {"working_dir": working_dir, "env_vars": env},
            "metadata": {"reef_job": submission.removeprefix("reef-")},
            **{f"entrypoint_{k}": v for k, v in self.resources.items()}})
        if status != 200:
            raise RayUnavailable(f"the Ray cluster at {self.address} did not take job {submission} "
                                 f"({status}): {_tail(answer)}")
        log.info("submitted Ray job %s to %s", submission, self.address)

    def package(self, spec: Path) -> bytes:
        """The job's working_dir, zipped: the spec (with its batch) at its root."""
        return zip_files({spec.name: spec.read_bytes()})

    def entrypoint(self, spec: Path) -> str:
        """The job's command, run in its working_dir."""
        return f"exec {shlex.quote(sys.executable)} -m reefd.train --spec {shlex.quote(spec.name)}"

    async def _upload(self, spec: Path) -> str:
        """The job's package in the cluster's store; its `gcs://` URI. Content-addressed, as Ray names packages:
        one already there is not sent again."""
        data = await asyncio.to_thread(self.package, spec)
        name = f"_ray_pkg_{hashlib.sha1(data).hexdigest()}.zip"
        status, _ = await self._call("GET", f"/api/packages/gcs/{name}")
        if status != 200:
            status, answer = await self._call("PUT", f"/api/packages/gcs/{name}", data=data)
            if status != 200:
                raise RayUnavailable(f"the Ray cluster at {self.address} did not take the job's files "
                                     f"({status}): {_tail(answer)}")
        return f"gcs://{name}"

    async def _follow(self, submission: str, on_event: Callable[[Event], None], started: float, deadline: float) -> int:
        seen = 0
        lines: list[str] = []
        stopped_at: float | None = None  # when reefd stopped it (the timeout)
        unanswered: float | None = None  # since when the cluster has not answered
        while True:
            try:
                _, info = await self._call("GET", f"/api/jobs/{submission}")
                _, logs = await self._call("GET", f"/api/jobs/{submission}/logs")
                unanswered = None
            except RayUnavailable as exc:
                now = time.monotonic()
                unanswered = unanswered or now
                if stopped_at is None and now > deadline:  # past its timeout: stopped, as below
                    with contextlib.suppress(RayUnavailable):
                        await self._call("POST", f"/api/jobs/{submission}/stop")
                    stopped_at = now
                if stopped_at is not None:  # what it saved while stopping may be there: the runner looks
                    if now > stopped_at + self.STOP_WAIT_S:
                        raise TrainerTimeout(f"the Ray job {submission} ran past its timeout; reefd asked it to "
                                             f"stop, but the cluster stopped answering: {exc}") from None
                elif now - unanswered >= self.UNREACHABLE_S:
                    with contextlib.suppress(RayUnavailable):  # given up on: it must not train on unwatched
                        await self._call("POST", f"/api/jobs/{submission}/stop")
                    raise RayUnavailable(f"{exc} (for {now - unanswered:.0f} s; its Ray job {submission} was asked "
                                         "to stop, and may still run)") from None
                await asyncio.sleep(self.SLOW_POLL_S)
                continue
            state = info.get("status") if isinstance(info, dict) else None
            text = logs.get("logs", "") if isinstance(logs, dict) else ""
            lines = text.splitlines(keepends=True)
            for line in lines[seen:]:
                if not line.endswith("\n") and state not in TERMINAL:
                    break  # a line still being written: read it whole next time
                seen += 1
                if line.startswith("{"):
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict) and "event" in event:
                        on_event(event)
            now = time.monotonic()
            if stopped_at is not None and (state in TERMINAL or now > stopped_at + self.STOP_WAIT_S):
                raise TrainerTimeout(f"the Ray job {submission} ran past its timeout; it was stopped")
            if state in TERMINAL:
                return self._exit_status(submission, info, lines, on_event)
            if state == "PENDING" and (now > deadline or now - started > self.START_TIMEOUT_S):
                # queued on the job's supervisor: it stops the job the moment the cluster could start it
                await self._call("POST", f"/api/jobs/{submission}/stop")
                asks = ", ".join(f"{k} {v}" for k, v in self.resources.items())
                raise RayUnavailable(f"the Ray job {submission} did not start within {round(now - started)} s: "
                                     f"the cluster at {self.address} has no room for it"
                                     + (f" (it asks for {asks})" if asks else "") + f": {_tail(info.get('message'))}")
            if stopped_at is None and now > deadline:
                with contextlib.suppress(RayUnavailable):  # a cluster that does not answer: retried above
                    await self._call("POST", f"/api/jobs/{submission}/stop")
                stopped_at = now  # what the trainer says while it saves still comes through
            await asyncio.sleep(self.POLL_S if now - started < 60 or stopped_at else self.SLOW_POLL_S)

    @staticmethod
    def _exit_status(submission: str, info: dict[str, Any], lines: list[str], on_event: Callable[[Event], None]) -> int:
        """0 when the job succeeded; else its exit code (1 without one), after an error event with the cluster's
        message and the last lines of the job's log (which end with the trainer's own error, or its traceback)."""
        if info.get("status") == "SUCCEEDED":
            return 0
        code = 143 if info.get("status") == "STOPPED" else info.get("driver_exit_code")  # stopped: SIGTERM
        tail = [line.strip() for line in lines if line.strip()][-LOG_TAIL_LINES:]
        message = str(info.get("message") or "").split(", last available logs")[0]  # the log follows, once
        on_event({"event": "error", "reason": f"the Ray job {submission} {str(info.get('status')).lower()}: "
                                              f"{_tail(message)}"
                                              + (" | log: " + _tail(" | ".join(tail), 1500) if tail else "")})
        return code if isinstance(code, int) and code != 0 else 1


LOG_TAIL_LINES = 8


def zip_files(files: dict[str, bytes]) -> bytes:
    """A working_dir package holding these files at its root: the same files make the same package."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def _tail(value: Any, limit: int = 500) -> str:
    text = " ".join(str(value or "").split())
    return text if len(text) <= limit else "..." + text[-limit:]
