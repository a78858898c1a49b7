"""`recipe.backend: ray`: weight jobs as Ray jobs, through the Ray Jobs REST API of a cluster's dashboard
(`POST /api/jobs/`, `GET /api/jobs/{id}` and `/logs`, `POST /api/jobs/{id}/stop`). reefd never imports ray.

The job runs `python -m reefd.train --spec FILE` on the cluster, exactly as the local backend does, and its
JSON-line events come back through the job's logs, polled. The submission id is the Reef job id (`reef-<job>`),
so a job submitted again (a reefd restart mid-job) attaches to the one that exists instead of training twice.
The spec, the base model and the output folder are paths that reefd and the cluster share: a head on the same
machine, or a shared filesystem with the same checkout and virtual environment at the same paths.

Address: the scenario's `recipe.ray_address`, else REEF_RAY_ADDRESS (the dashboard, http://host:8265). Token
(Ray's `RAY_AUTH_MODE=token`): RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else the systemd
credential `ray-token` ($CREDENTIALS_DIRECTORY/ray-token). Torch-free, ray-free: the daemon's side.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from reefd.train.backends import Event, TrainerTimeout

log = logging.getLogger("reefd.train")
ROOT = Path(__file__).resolve().parents[2]
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

    def __init__(self, work_dir: Path, max_jobs: int = 1, address: str | None = None) -> None:
        self.work_dir, self.max_jobs = work_dir, max_jobs
        self.address = (address or os.environ.get(ADDRESS_ENV) or "").rstrip("/")
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

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        if not self.address:
            raise RayUnavailable(f"no Ray cluster address: set recipe.ray_address or {ADDRESS_ENV}")
        try:
            async with self._http().request(method, f"{self.address}{path}", json=body) as r:
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

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int:
        """Submit (or find) the job, relay its event lines, return its exit status; TrainerTimeout past
        `timeout_s` (the job is stopped). A cluster that cannot run it gives an error event and status 1."""
        job = str(json.loads(Path(spec).read_text()).get("job") or Path(spec).parent.name)
        submission = f"reef-{job}"
        deadline = time.monotonic() + timeout_s
        try:
            await self._submit(submission, spec)
            return await self._follow(submission, on_event, deadline)
        except RayUnavailable as exc:
            on_event({"event": "error", "reason": str(exc)})
            return 1

    async def _submit(self, submission: str, spec: Path) -> None:
        status, found = await self._call("GET", f"/api/jobs/{submission}")
        if status == 200 and isinstance(found, dict):
            log.info("Ray job %s exists (%s): following it", submission, found.get("status"))
            return
        entrypoint = (f"cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -m reefd.train "
                      f"--spec {shlex.quote(str(Path(spec).resolve()))}")
        # the trainer's own switches (REEF_TRAIN_*: faults for tests, holds) travel with the job
        env = {k: v for k, v in os.environ.items() if k.startswith("REEF_TRAIN_")}
        status, answer = await self._call("POST", "/api/jobs/", {
            "entrypoint": entrypoint, "submission_id": submission, "runtime_env": {"env_vars": env} if env else None,
            "metadata": {"reef_job": submission.removeprefix("reef-")}})
        if status != 200:
            raise RayUnavailable(f"the Ray cluster at {self.address} did not take job {submission} "
                                 f"({status}): {_tail(answer)}")
        log.info("submitted Ray job %s to %s", submission, self.address)

    async def _follow(self, submission: str, on_event: Callable[[Event], None], deadline: float) -> int:
        seen, started = 0, time.monotonic()
        while True:
            _, info = await self._call("GET", f"/api/jobs/{submission}")
            state = info.get("status") if isinstance(info, dict) else None
            _, logs = await self._call("GET", f"/api/jobs/{submission}/logs")
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
            if state in TERMINAL:
                return self._exit_status(submission, info, on_event)
            now = time.monotonic()
            if now > deadline:
                await self._call("POST", f"/api/jobs/{submission}/stop")
                raise TrainerTimeout(f"the Ray job {submission} ran past its timeout; it was stopped")
            if state == "PENDING" and now - started > self.START_TIMEOUT_S:
                await self._call("POST", f"/api/jobs/{submission}/stop")
                raise RayUnavailable(f"the Ray job {submission} did not start within "
                                     f"{self.START_TIMEOUT_S:.0f} s (is the cluster short of resources?)")
            await asyncio.sleep(self.POLL_S)

    @staticmethod
    def _exit_status(submission: str, info: dict[str, Any], on_event: Callable[[Event], None]) -> int:
        code = info.get("driver_exit_code")
        if info.get("status") == "SUCCEEDED":
            return 0
        if isinstance(code, int) and code != 0:
            return code
        on_event({"event": "error", "reason": f"the Ray job {submission} {str(info.get('status')).lower()}: "
                                              f"{_tail(info.get('message'))}"})
        return 1


def _tail(value: Any, limit: int = 500) -> str:
    text = " ".join(str(value or "").split())
    return text if len(text) <= limit else "..." + text[-limit:]
