"""A scenario's users: who they are, what serves each of them, and their records and reports
(`GET /reef/scenarios/{name}/users`, `reefctl users`; a user's token sees its own user only), and deleting one
(`DELETE /reef/scenarios/{name}/users/{user}`, `reefctl users delete`): every byte of theirs, across the stages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError, json_response, read_json, shown
from reefd.commit.erase import drop_line, prune
from reefd.commit.proofs import probe_of
from reefd.grow.schedule import CannotCancel
from reefd.loop import CHAIN, CONVERSATIONS, RECONCILER, RECORDS, REGISTRY, SCHEDULER
from reefd.observe.retention import receipts_of
from reefd.ops.auth import KEYRING
from reefd.ops.tokens import TokensFileError, revoke_user
from reefd.serve.scenarios import Scenario

log = logging.getLogger("reefd.api.users")


async def list_users(request: web.Request) -> web.Response:
    scenario = access.scenario(request, request.match_info["name"], param="name")
    if scenario.cfg.users is None:
        raise ApiError(400, f"scenario {shown(scenario.name)} does not learn per user (its file has no users: block)",
                       param="name", code="users_off")
    known = request.app[REGISTRY].users.known(scenario.name)
    counts = await asyncio.to_thread(request.app[RECORDS].user_counts, scenario.name)
    lines, jobs = request.app[RECONCILER].users, request.app[SCHEDULER].jobs
    only = access.grant(request).user
    rows: list[dict[str, Any]] = []
    for name in sorted(known):
        if only is not None and name != only:
            continue
        own, why = lines.head(scenario.name, name), lines.why(scenario.name, name)
        last = jobs.last(scenario.name, name)
        rows.append({"user": name, "since": known[name].get("since"), "share": known[name].get("share") is True,
                     "own_release": own,
                     "last_job": None if last is None else {"id": last.id, "state": last.state,
                                                            "release": last.release},
                     "release": lines.serving(scenario, name),
                     **({"why": why} if why else {}),
                     **counts.get(name, {"records": 0, "reports": 0})})
    return json_response({"object": "list", "scenario": scenario.name, "max": scenario.cfg.users.max,
                          "slots": scenario.cfg.users.slots, "shared_release": scenario.release, "data": rows})


async def patch_user(request: web.Request) -> web.Response:
    """Set what a user consents to: `{"share": true}` lets promotions (`users.share`) learn from the records
    their own releases learned from; false withdraws it. A user's token sets its own user's; 404 for a user
    nobody knows."""
    scenario = access.scenario(request, request.match_info["name"], param="name")
    user = access.line_of(request, scenario, request.match_info["user"])
    assert user is not None
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) != {"share"} or not isinstance(body["share"], bool):
        raise ApiError(400, 'the body must be {"share": true} or {"share": false}', param="share",
                       code="invalid_request")
    if not await request.app[REGISTRY].users.set_share(scenario.name, user, body["share"]):
        raise ApiError(404, f"no user {shown(user)} in scenario {shown(scenario.name)}", param="user",
                       code="user_not_found")
    return json_response({"object": "reef.user", "scenario": scenario.name, "user": user, "share": body["share"],
                          "promotions": scenario.cfg.users.share if scenario.cfg.users is not None else False})


async def delete_user(request: web.Request) -> web.Response:
    """Remove every byte of a user's: their records and reports, sessions, release line, adapters, LFS objects,
    jobs and their place among the users; their receipts answer 404 after. 404 for a user nobody knows."""
    scenario = access.scenario(request, request.match_info["name"], param="name")
    user = access.line_of(request, scenario, request.match_info["user"])
    assert user is not None
    app = request.app
    registry, lines, chain = app[REGISTRY], app[RECONCILER].users, app[CHAIN]
    has_line = user in await asyncio.to_thread(chain.users, scenario.name)
    if user not in registry.users.known(scenario.name) and not has_line:
        raise ApiError(404, f"no user {shown(user)} in scenario {shown(scenario.name)}", param="user",
                       code="user_not_found")
    registry.users.deleting.add((scenario.name, user))
    try:
        await registry.users.quiet(scenario.name, user, scenario.cfg.serve.request_timeout_s)  # turns under way
        cancelled = await _stop_jobs(request, scenario.name, user)
        await lines.forget(scenario, user)
        erased = await erase(app, scenario, user)
        await registry.users.forget(scenario.name, user)
        revoked = await _revoke(app, scenario.name, user)  # before their turns are let through again
    finally:
        registry.users.deleting.discard((scenario.name, user))
    return json_response({"object": "reef.user.deleted", "scenario": scenario.name, "user": user,
                          "cancelled_jobs": cancelled, **erased, **revoked})


async def _revoke(app: web.Application, scenario: str, user: str) -> dict[str, list[str]]:
    """The user's tokens limited to this scenario revoked (and no longer accepted), those reaching other
    scenarios kept and named. A tokens file reefd cannot write keeps them all, named, with the reason logged."""
    keyring = app[KEYRING]
    if keyring.file is None:
        return {"tokens_revoked": [], "tokens_kept": []}
    try:
        revoked, kept = await asyncio.to_thread(revoke_user, keyring.file, scenario, user)
    except (OSError, TokensFileError) as exc:
        log.warning("deleting user %r of %s: cannot revoke their tokens in %s: %s", user, scenario, keyring.file, exc)
        return {"tokens_revoked": [], "tokens_kept": [
            e.grant.name for e in keyring.entries() if e.grant.user == user and e.grant.covers(scenario)]}
    if revoked:
        try:
            keyring.reload()
        except (OSError, TokensFileError) as exc:  # the file was just written; a SIGHUP reads it again
            log.error("deleting user %r of %s: revoked %s in %s, but cannot read it back: %s", user, scenario,
                      revoked, keyring.file, exc)
    return {"tokens_revoked": revoked, "tokens_kept": kept}


async def _stop_jobs(request: web.Request, scenario: str, user: str) -> list[str]:
    """Cancel the user's queued or running job; one already publishing is let finish (its release then goes
    with the rest of the line)."""
    scheduler, cancelled = request.app[SCHEDULER], []
    while (job := scheduler.jobs.active(scenario, user)) is not None:
        try:
            await scheduler.cancel(job)
            cancelled.append(job.id)
        except CannotCancel:
            await asyncio.sleep(0.1)
    return cancelled


async def erase(app: web.Application, scenario: Scenario, user: str) -> dict[str, Any]:
    """The user's bytes gone from the chain, the serving folders, the fingerprints, the records and the jobs;
    what was removed, and the shared releases whose lineage named their records."""
    chain, store, files = app[CHAIN], app[RECORDS], app[RECONCILER].files
    own = await asyncio.to_thread(chain.history, scenario.name, include_rejected=True, user=user)
    releases = [r for r in own if r.user == user]
    trees = [await asyncio.to_thread(chain.artifacts, r.id) for r in releases]
    receipts = set(await asyncio.to_thread(store.user_receipts, scenario.name, user))
    shared = [r.id for r in await asyncio.to_thread(chain.history, scenario.name) if receipts & _learned(r.meta)]
    dropped = await asyncio.to_thread(drop_line, chain, scenario.name, user)
    pruned = await asyncio.to_thread(prune, chain)
    for rel in releases:
        await files.drop_adapters(f"{scenario.name}/{rel.id}")
    probe = probe_of(scenario.cfg.release.proof)
    for t in trees:
        await asyncio.to_thread(files.proofs.forget, (t.get("weights"), t.get("adapter")), probe)
    records = await store.delete_user(scenario.name, user)
    jobs = await asyncio.to_thread(app[SCHEDULER].jobs.forget, scenario.name, user)
    sessions = app[CONVERSATIONS].forget_user(scenario.name, user)
    return {"records": records, "releases": dropped, "jobs": jobs, "sessions": sessions, **pruned,
            "shared_releases_learned_from": shared}


def _learned(meta: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    receipts_of(meta, out)
    return out
