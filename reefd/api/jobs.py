"""Grow jobs over HTTP: start one (`reefctl train`), list them, follow one, cancel one (`reefctl cancel`).

Knows the admin wire shapes; reefd/grow/schedule.py decides when jobs run and reefd/grow/runner.py runs them.
"""

from __future__ import annotations

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError, json_response, read_json, shown
from reefd.grow.job_store import Job
from reefd.grow.promotion import PROMOTE
from reefd.grow.recipes import build
from reefd.grow.schedule import CannotCancel
from reefd.loop import SCHEDULER


async def train(request: web.Request) -> web.Response:
    """Queue a job now (202), or return the scenario's queued or running job (200): one per scenario."""
    scenario = access.scenario(request, request.match_info["name"], param="name")
    recipe = build(scenario.cfg.recipe.name, scenario.cfg.recipe.params)
    if recipe.produces == "nothing":
        raise ApiError(400, f"scenario {scenario.name!r} uses the {scenario.cfg.recipe.name!r} recipe, which does "
                       "not train; set recipe.name in its file (e.g. sao)", code="recipe_does_not_train")
    body = await read_json(request) if request.can_read_body else {}
    body = body if isinstance(body, dict) else {}
    user = access.line_of(request, scenario, body.get("user"))
    promote = body.get("promote", False)
    if not isinstance(promote, bool):
        raise ApiError(400, "promote: must be true or false", param="promote", code="invalid_request")
    if promote and (user is not None or scenario.cfg.users is None or not scenario.cfg.users.share):
        raise ApiError(400, "promote: a promotion trains the shared line of a scenario with users.share: true "
                       "(and names no user)", param="promote", code="sharing_off")
    scheduler = request.app[SCHEDULER]
    existing = scheduler.jobs.active(scenario.name, user)
    job = await scheduler.submit(scenario.name, PROMOTE if promote else "manual", user)
    return json_response(job.as_json(), status=200 if existing is job else 202)


async def list_jobs(request: web.Request) -> web.Response:
    name = request.query.get("scenario") or None
    if name is not None:
        access.scenario(request, name, param="scenario")  # 404 for an unknown scenario, 403 for another's
    jobs = [j for j in request.app[SCHEDULER].jobs.list(name)
            if access.covers(request, j.scenario) and access.sees_line(request, j.user)]
    return json_response({"object": "list", "data": [j.as_json() for j in jobs]})


def _job(request: web.Request) -> Job:
    job = request.app[SCHEDULER].jobs.jobs.get(request.match_info["job"])
    if job is None or not access.covers(request, job.scenario) or not access.sees_line(request, job.user):
        raise ApiError(404, f"no job {shown(request.match_info['job'])}", code="job_not_found")
    return job


async def get_job(request: web.Request) -> web.Response:
    return json_response(_job(request).as_json())


async def cancel_job(request: web.Request) -> web.Response:
    """Stop a queued or running job (its trainer too, wherever it runs); 409 once it ended or is publishing."""
    try:
        job = await request.app[SCHEDULER].cancel(_job(request))
    except CannotCancel as exc:
        raise ApiError(409, str(exc), code="job_not_cancellable") from None
    return json_response(job.as_json())
