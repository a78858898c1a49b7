"""The aiohttp app factory: the middlewares, the routes by stage of the loop, and the loop's resources
(reefd/loop.py, where the edges between Serve, Observe, Grow and Commit are wired).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from reefd import loop
from reefd.api import access, admin, anthropic, openai, reports, responses, tinker_routes
from reefd.api import delivery as harness_api
from reefd.api import export as export_api
from reefd.api import jobs as jobs_api
from reefd.api import releases as release_api
from reefd.api import search as search_api
from reefd.api import users as users_api
from reefd.api.errors import SCENARIO_HEADER, ApiError, error_middleware
from reefd.api.openapi import openapi_json
from reefd.loop import Settings
from reefd.ops import malloc
from reefd.ops.auth import ANY, KEYRING, ROUTE_SCOPES, Keyring, auth_middleware
from reefd.ops.metrics import INSTALL_HINT

__all__ = ["Settings", "build_app", "metrics_app"]


# The agent APIs, by handler, as reef_requests{api} names them.
AGENT_APIS: dict[Callable[..., object], str] = {
    openai.chat_completions: "openai.chat_completions", anthropic.count_tokens: "anthropic.count_tokens",
    anthropic.messages: "anthropic.messages", responses.create: "openai.responses", reports.report: "reef.report"}


@web.middleware
async def edge(request: web.Request,
               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Around every request: reef_requests{scenario, api, status} counts each agent API request with the status its
    caller got; and after a request with a big body (a long prompt, an upload), the memory it used goes back to
    the system."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        api = AGENT_APIS.get(request.match_info.route.handler)
        if api is not None and (m := loop.of(request.app)) is not None:
            m.request(request.match_info.get("scenario") or request.headers.get(SCENARIO_HEADER), api, status)
        if (request.content_length or 0) > malloc.BIG_BODY:
            await asyncio.to_thread(malloc.trim)


async def _scrape(main: web.Application) -> web.Response:
    """`main`'s metrics: a snapshot taken here, on the event loop, rendered in a thread (it reads LMDB)."""
    m = loop.of(main)
    if m is None:
        raise ApiError(501, f"metrics need prometheus_client: {INSTALL_HINT}", code="not_installed")
    body, ctype = await asyncio.to_thread(m.exposition, loop.scrape_state(main))
    return web.Response(body=body, headers={"Content-Type": ctype})


async def metrics_route(request: web.Request) -> web.Response:
    access.require_everything(request, "/metrics")
    return await _scrape(request.app)


def metrics_app(main: web.Application) -> web.Application:
    """`/metrics` alone, without a token, for REEF_METRICS_LISTEN (a scraper on loopback): reads `main`'s state."""
    app = web.Application(middlewares=[error_middleware])

    async def scrape(request: web.Request) -> web.Response:
        return await _scrape(main)

    app.router.add_get("/metrics", scrape)
    return app


# The scope each route needs (reefd/ops/tokens.py): `serve` for agents, `report` for feedback, `read` for operators'
# reads, `admin` for what changes the chain or starts work, `train` for the Tinker API. A handler missing here needs
# `admin`.
SCOPES: dict[Callable[..., object], str] = {
    openai.chat_completions: "serve", anthropic.messages: "serve", anthropic.count_tokens: "serve",
    responses.create: "serve", responses.refuse_get: "serve", responses.retrieve: "serve",
    openai.list_models: "serve", search_api.next_step: "serve",
    harness_api.get_harness: "serve", harness_api.releases: "serve", harness_api.install: "serve",
    reports.report: "report", users_api.patch_user: "report",
    admin.get_record: "read", admin.list_records: "read", admin.status: "read",
    release_api.history: "read", release_api.show: "read", release_api.diff: "read", release_api.lineage: "read",
    search_api.archive: "read", jobs_api.list_jobs: "read", jobs_api.get_job: "read", metrics_route: "read",
    export_api.export: "read", users_api.list_users: "read",
    release_api.publish: "admin", release_api.rollback: "admin", release_api.promote: "admin",
    jobs_api.train: "admin", jobs_api.cancel_job: "admin", users_api.delete_user: "admin",
    admin.healthz: ANY, admin.readyz: ANY, openapi_json: ANY,
    **tinker_routes.SCOPES,
}


def build_app(settings: Settings) -> web.Application:
    keyring = Keyring(settings.tokens, settings.tokens_file)
    keyring.reload()  # TokensFileError: reefd does not start on a tokens file it cannot use
    app = web.Application(middlewares=[edge, error_middleware,
                                       auth_middleware(keyring, SCOPES)],
                          client_max_size=64 * 1024 * 1024)
    app[KEYRING] = keyring
    app[ROUTE_SCOPES] = SCOPES
    loop.install(app, settings)

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
    app.router.add_get("/reef/scenarios/{name}/export", export_api.export)  # JSON lines, streamed
    app.router.add_get("/reef/status", admin.status)
    app.router.add_get("/reef/scenarios/{name}/users", users_api.list_users)
    app.router.add_delete("/reef/scenarios/{name}/users/{user}", users_api.delete_user)
    app.router.add_patch("/reef/scenarios/{name}/users/{user}", users_api.patch_user)
    # Commit: the release chain. Writes are compare-and-swap on the head, then a hot swap.
    app.router.add_get("/reef/scenarios/{name}/releases", release_api.history)
    app.router.add_post("/reef/scenarios/{name}/releases", release_api.publish)
    app.router.add_post("/reef/scenarios/{name}/rollback", release_api.rollback)
    app.router.add_post("/reef/scenarios/{name}/promote", release_api.promote)
    app.router.add_get("/reef/releases/{release}", release_api.show)
    app.router.add_get("/reef/releases/{release}/lineage", release_api.lineage)
    app.router.add_get("/reef/diff", release_api.diff)
    # Grow: jobs that turn records and reports into candidates.
    app.router.add_post("/reef/scenarios/{name}/train", jobs_api.train)
    app.router.add_post("/reef/scenarios/{name}/attempts/next", search_api.next_step)
    app.router.add_get("/reef/scenarios/{name}/archive", search_api.archive)
    app.router.add_get("/reef/jobs", jobs_api.list_jobs)
    app.router.add_get("/reef/jobs/{job}", jobs_api.get_job)
    app.router.add_post("/reef/jobs/{job}/cancel", jobs_api.cancel_job)
    # The harness: files per release, and installers for coding agents.
    app.router.add_get("/reef/harness", harness_api.get_harness)
    app.router.add_get("/reef/harness/releases", harness_api.releases)
    app.router.add_get("/reef/harness/install", harness_api.install)
    app.router.add_get("/healthz", admin.healthz)
    app.router.add_get("/", admin.healthz)  # HEAD / is Claude Code's connectivity probe
    app.router.add_get("/readyz", admin.readyz)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/openapi.json", openapi_json)
    # Grow, for loops of their own: the Tinker training API (its routes and scopes declared in one table)
    tinker_routes.add(app)
    return app
