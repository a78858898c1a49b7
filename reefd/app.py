"""The aiohttp app factory: the middlewares, the routes by stage of the loop, and the loop's resources
(reefd/loop.py, where the edges between Serve, Observe, Grow and Commit are wired).
"""

from __future__ import annotations

from aiohttp import web

from reefd import loop
from reefd.api import admin, anthropic, openai, reports, responses
from reefd.api import attempts as attempts_api
from reefd.api import harness as harness_api
from reefd.api import jobs as jobs_api
from reefd.api import releases as release_api
from reefd.api.errors import error_middleware
from reefd.auth import auth_middleware
from reefd.loop import Settings

__all__ = ["Settings", "build_app"]


def build_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware(settings.tokens)],
                          client_max_size=64 * 1024 * 1024)
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
    app.router.add_post("/reef/scenarios/{name}/attempts/next", attempts_api.next_step)
    app.router.add_get("/reef/scenarios/{name}/archive", attempts_api.archive)
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
    return app
