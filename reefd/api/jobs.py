"""Grow jobs over HTTP: start one (`reefctl train`), list them, follow one.

Knows the admin wire shapes; reefd/schedule.py decides when jobs run and reefd/runner.py runs them.
"""

from __future__ import annotations

from aiohttp import web

from reefd.api.errors import ApiError, json_response
from reefd.loop import REGISTRY, SCHEDULER
from reefd.recipes import build


async def train(request: web.Request) -> web.Response:
    """Queue a job now (202), or return the scenario's queued or running job (200): one per scenario."""
    scenario = request.app[REGISTRY].get(request.match_info["name"])
    recipe = build(scenario.cfg.recipe.name, scenario.cfg.recipe.params)
    if recipe.produces == "nothing":
        raise ApiError(400, f"scenario {scenario.name!r} uses the {scenario.cfg.recipe.name!r} recipe, which does "
                       "not train; set recipe.name in its file (e.g. sao)", code="recipe_does_not_train")
    scheduler = request.app[SCHEDULER]
    existing = scheduler.jobs.active(scenario.name)
    job = await scheduler.submit(scenario.name, "manual")
    return json_response(job.as_json(), status=200 if existing is job else 202)


async def list_jobs(request: web.Request) -> web.Response:
    name = request.query.get("scenario") or None
    if name is not None:
        request.app[REGISTRY].get(name)  # 404 for an unknown scenario
    jobs = request.app[SCHEDULER].jobs.list(name)
    return json_response({"object": "list", "data": [j.as_json() for j in jobs]})


async def get_job(request: web.Request) -> web.Response:
    job = request.app[SCHEDULER].jobs.jobs.get(request.match_info["job"])
    if job is None:
        raise ApiError(404, f"no job {request.match_info['job']!r}", code="job_not_found")
    return json_response(job.as_json())
