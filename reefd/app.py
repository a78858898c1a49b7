"""The aiohttp app factory: Reef's loop at a glance, each resource a cleanup context.

Serve (OpenAI / Anthropic APIs → scenario engine) → Observe (records + reports in LMDB).
Grow and Commit (recipes, gates, the release chain) plug in beside these resources.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from reefd.api import admin, anthropic, openai, reports, responses
from reefd.api import harness as harness_api
from reefd.api import jobs as jobs_api
from reefd.api import releases as release_api
from reefd.api.errors import error_middleware
from reefd.api.keys import CHAIN, REGISTRY, SCHEDULER, STARTED_AT, STORE
from reefd.auth import auth_middleware
from reefd.config import ScenarioConfig
from reefd.records import RecordStore
from reefd.releases import ReleaseChain
from reefd.scenarios import Registry
from reefd.schedule import Scheduler

log = logging.getLogger("reefd")
HTTP = web.AppKey("http", aiohttp.ClientSession)


@dataclass
class Settings:
    """How this daemon runs (flags and environment), as opposed to what it serves (scenarios)."""

    state_dir: Path
    tokens: list[str]
    records_map_size: int = 1 << 30
    shutdown_timeout_s: float = 30.0
    scenarios: dict[str, ScenarioConfig] = field(default_factory=dict)
    scenarios_dir: Path = Path("scenarios")  # gate task files are relative to it
    max_jobs: int = 1  # Grow jobs running at once, across every scenario


def build_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware(settings.tokens)],
                          client_max_size=64 * 1024 * 1024)
    app[STARTED_AT] = time.time()

    async def records(app: web.Application) -> AsyncIterator[None]:  # Observe
        app[STORE] = RecordStore(settings.state_dir / "records",
                                 map_size=settings.records_map_size)
        await app[STORE].open()
        yield
        await app[STORE].close()

    async def http_client(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        app[HTTP] = aiohttp.ClientSession(connector=connector, trust_env=False,
                                          json_serialize=lambda o: orjson.dumps(o).decode())
        yield
        await app[HTTP].close()

    async def releases(app: web.Application) -> AsyncIterator[None]:  # Commit
        app[CHAIN] = ReleaseChain(settings.state_dir / "releases.git")
        for lock in app[CHAIN].clear_stale_locks():  # reefd is the chain's only writer
            log.warning("removed a stale release lock left by a killed writer: %s", lock)
        # uploads and materialized adapters an earlier run left behind (they are rebuilt from the chain)
        for stale in [*(settings.state_dir / "releases.git" / "lfs" / "tmp").iterdir(),
                      settings.state_dir / "serving"]:
            if stale.is_dir():
                await asyncio.to_thread(shutil.rmtree, stale, True)
            else:
                stale.unlink(missing_ok=True)
        yield

    async def engines(app: web.Application) -> AsyncIterator[None]:  # Serve
        app[REGISTRY] = Registry(settings.scenarios, settings.state_dir, app[HTTP], app[CHAIN],
                                 settings.scenarios_dir)
        await app[REGISTRY].start()
        yield
        await app[REGISTRY].stop()

    async def grow(app: web.Application) -> AsyncIterator[None]:  # Grow: triggers and jobs
        app[SCHEDULER] = Scheduler(app[REGISTRY], app[STORE], app[CHAIN], settings.state_dir,
                                   settings.scenarios_dir, max_jobs=settings.max_jobs)
        app[SCHEDULER].start()
        yield
        await app[SCHEDULER].stop()

    app.cleanup_ctx.extend([records, http_client, releases, engines, grow])

    # Serve: provider-native agent APIs, by header or by path.
    for prefix in ("", "/scenarios/{scenario}"):
        app.router.add_post(prefix + "/v1/chat/completions", openai.chat_completions)
        app.router.add_post(prefix + "/v1/messages", anthropic.messages)
        app.router.add_post(prefix + "/v1/messages/count_tokens", anthropic.count_tokens)
        app.router.add_post(prefix + "/v1/responses", responses.create)
        app.router.add_get(prefix + "/v1/responses", responses.refuse_get)  # WebSocket: 426
        app.router.add_get(prefix + "/v1/responses/{response_id}", responses.retrieve)
    app.router.add_get("/v1/models", openai.list_models)
    # Observe: feedback on receipts, and reads for operators.
    app.router.add_post("/reef/report", reports.report)
    app.router.add_get("/reef/records/{receipt}", admin.get_record)
    app.router.add_get("/reef/scenarios/{name}/records", admin.list_records)
    app.router.add_get("/reef/status", admin.status)
    # Commit: the release chain. Writes are compare-and-swap on the head, then a hot swap.
    app.router.add_get("/reef/scenarios/{name}/releases", release_api.history)
    app.router.add_post("/reef/scenarios/{name}/releases", release_api.publish)
    app.router.add_post("/reef/scenarios/{name}/rollback", release_api.rollback)
    app.router.add_post("/reef/scenarios/{name}/promote", release_api.promote)
    app.router.add_get("/reef/releases/{release}", release_api.show)
    app.router.add_get("/reef/diff", release_api.diff)
    # Grow: jobs that turn records and reports into candidates.
    app.router.add_post("/reef/scenarios/{name}/train", jobs_api.train)
    app.router.add_get("/reef/jobs", jobs_api.list_jobs)
    app.router.add_get("/reef/jobs/{job}", jobs_api.get_job)
    # The harness: files per release, and installers for coding agents.
    app.router.add_get("/reef/harness", harness_api.get_harness)
    app.router.add_get("/reef/harness/releases", harness_api.releases)
    app.router.add_get("/reef/harness/install", harness_api.install)
    app.router.add_get("/healthz", admin.healthz)
    app.router.add_get("/", admin.healthz)  # HEAD / is Claude Code's connectivity probe
    app.router.add_get("/readyz", admin.readyz)
    return app
