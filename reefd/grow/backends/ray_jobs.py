"""`recipe.backend: ray`: weight jobs as Ray jobs, through the Ray Jobs REST API of a cluster's dashboard
(`POST /api/jobs/`, `GET /api/jobs/{id}` and `/logs`, `POST /api/jobs/{id}/stop`, `PUT /api/packages/...`).
reefd never imports ray.

The job runs `python -m reefd.train --spec spec.json` on the cluster, as the local backend does, and its
JSON-line events come back through the job's logs, polled. The submission id is the Reef job id (`reef-<job>`),
so a job submitted again (a reefd restart mid-job) attaches to the one that exists instead of training twice.
The spec, with the batch in it, travels as the job's `runtime_env.working_dir`: a zip uploaded to the cluster's
own package store (`gcs://_ray_pkg_<sha1>.zip`, as Ray's job SDK does it). The base model, the adapter it
continues from and the output folder are paths the spec names: a head on the same machine, or a filesystem
the cluster shares with reefd (the same paths, and the same virtual environment at the same path).

Stopping (a cancel, the job timeout) is Ray's `stop_job`: SIGTERM, SIGKILL 3 s later; the trainer saves the steps
it finished. A job that fails shows the cluster's message and the last lines of its log.

Address: the scenario's `recipe.ray_address`, else REEF_RAY_ADDRESS (the dashboard, http://host:8265). Token
(Ray's `RAY_AUTH_MODE=token`): RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else the systemd
credential `ray-token` ($CREDENTIALS_DIRECTORY/ray-token). Torch-free, ray-free: the daemon's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import shlex
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from reefd.grow.backends.local import Event, TrainerTimeout

log = logging.getLogger("reefd.train")
ROOT = Path(__file__).resolve().parents[3]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
ADDRESS_ENV = "REEF_RAY_ADDRESS"


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
    """Weight jobs on a Ray cluster (`Class(work_dir, max_jobs, address)`)."""

    detachable = True  # a job outlives reefd: after a restart, `run` with the same spec follows it
    POLL_S = 0.5
    START_TIMEOUT_S = 300.0  # a job that never leaves PENDING (no resources, a dead cluster) fails after this
    STOP_WAIT_S = 10.0  # after `stop`: Ray's 3 s to SIGKILL, and the poll that sees the job end
    UNREACHABLE_S = 60.0  # a running job's cluster may fail to answer this long (a dashboard restart) before it fails
    SLOW_POLL_S = 2.0  # past the first minute, the job's state and log are read this often

    def __init__(self, work_dir: Path, max_jobs: int = 1, address: str | None = None,
                 resources: dict[str, Any] | None = None) -> None:
        self.work_dir, self.max_jobs = work_dir, max_jobs
        self.address = (address or os.environ.get(ADDRESS_ENV) or "").rstrip("/")
        self.resources = dict(resources or {})  # the entrypoint's: num_cpus, num_gpus, memory, resources
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
        if not self.address:
            raise RayUnavailable(f"no Ray cluster address: set recipe.ray_address or {ADDRESS_ENV}")
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
        # the trainer's own switches (REEF_TRAIN_*: faults for tests, holds) travel with the job
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
        return _zip_one(spec)

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

    async def _follow(self, submission: str, on_event: Callable[[Event], None], started: float,
                      deadline: float) -> int:
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
    def _exit_status(submission: str, info: dict[str, Any], lines: list[str],
                     on_event: Callable[[Event], None]) -> int:
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


def _zip_one(path: Path) -> bytes:
    """A zip holding `path` at its root (a working_dir package)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(path, path.name)
    return buf.getvalue()


def _tail(value: Any, limit: int = 500) -> str:
    text = " ".join(str(value or "").split())
    return text if len(text) <= limit else "..." + text[-limit:]
