"""The harness over HTTP: its files for a release, its releases, and installers for coding agents.

`curl -fsS -H "Authorization: Bearer $REEF_TOKEN" 'http://HOST:8900/reef/harness/install?adapter=claude' | sh`
Knows the wire shapes; the chain stores harness trees, reefd/harness parses them, reefd/harness/installer.py
writes the scripts.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from aiohttp import web

from reefd.api import access
from reefd.api.errors import SCENARIO_HEADER, ApiError, json_response, shown
from reefd.api.turns import RELEASE_HEADER
from reefd.commit.chain import Release, ReleaseChain, UnknownRelease, WrongScenario
from reefd.commit.materialize import read_harness
from reefd.harness import Harness
from reefd.harness.installer import ADAPTERS, installer
from reefd.loop import CHAIN, RECONCILER, REGISTRY
from reefd.serve.scenarios import Scenario


def _scenario(request: web.Request) -> Scenario:
    """By header, by ?scenario=, or the only scenario that has a harness."""
    registry = request.app[REGISTRY]
    name = request.headers.get(SCENARIO_HEADER) or request.query.get("scenario")
    if name:
        return access.scenario(request, name.strip(), param="scenario")
    with_harness = sorted(n for n, s in registry.scenarios.items() if access.covers(request, n) and (
        s.cfg.harness.dir or (s.binding is not None and s.binding.harness is not None)))
    if len(with_harness) == 1:
        return registry.scenarios[with_harness[0]]
    raise ApiError(400, f"name the scenario with ?scenario=NAME or the {SCENARIO_HEADER} header "
                   f"(scenarios with a harness: {', '.join(with_harness) or 'none'})",
                   param="scenario", code="scenario_missing")


def _files(harness: Harness) -> list[dict[str, Any]]:
    return [{"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
             "content": data.decode("utf-8")} for path, data in sorted(harness.files().items())]


def harness_versions(chain: ReleaseChain, scenario: str, user: str | None = None) -> list[Release]:
    """The releases that changed the harness (its first one included), newest first: a release whose harness
    tree is its parent's (an adapter release, say) is not a new harness version. `user`: on their line (their
    releases, then the shared ones it forked from)."""
    own = chain.history(scenario, user=user) if user is not None else []
    history = own or chain.history(scenario)  # a user with no line of their own is on the shared one
    trees = [chain.artifacts(r.id).get("harness") for r in history]
    return [r for i, r in enumerate(history) if trees[i] is not None and (i + 1 == len(history) or trees[i + 1]
                                                                             != trees[i])]


def _version(chain: ReleaseChain, rel: Release) -> Release:
    """The release that introduced `rel`'s harness (itself, or an ancestor with the same harness tree)."""
    tree = chain.artifacts(rel.id).get("harness")
    while rel.parent is not None:
        parent = chain.get(rel.parent)
        if chain.artifacts(parent.id).get("harness") != tree:
            break
        rel = parent
    return rel


def _serving(request: web.Request, scenario: Scenario, user: str | None) -> str | None:
    """The release serving the request's user (their line's head, as their turns are answered), or the
    scenario's."""
    return scenario.release if user is None else request.app[RECONCILER].users.serving(scenario, user)


async def _harness_of(request: web.Request, scenario: Scenario) -> tuple[Release, Harness]:
    """The harness the request's user is served (a user's token's, or x-reef-user's; their own line's where they
    have one), or the one of `?release=` on their line."""
    chain = request.app[CHAIN]
    user = access.user(request, scenario)
    wanted = request.query.get("release") or _serving(request, scenario, user)
    if wanted is None:
        raise ApiError(503, f"scenario {scenario.name!r} is not serving yet; retry shortly",
                       code="engine_unavailable", headers={"Retry-After": "2"})
    try:
        rel = await asyncio.to_thread(chain.target, scenario.name, wanted.removeprefix("release/"), user=user)
    except (UnknownRelease, WrongScenario) as exc:
        raise ApiError(404, f"no release {shown(wanted)} of scenario {scenario.name!r} ({exc})",
                       code="release_not_found") from None
    binding = scenario.binding
    harness = binding.harness if binding is not None and binding.release == rel.id else None
    if harness is None:
        harness = await asyncio.to_thread(read_harness, chain, rel.id)
    if harness is None:
        raise ApiError(404, f"release {rel.id} of scenario {scenario.name!r} has no harness "
                       "(set harness.dir in the scenario file)", code="harness_not_found")
    return await asyncio.to_thread(_version, chain, rel), harness


def harness_json(scenario: str, rel: Release, harness: Harness) -> dict[str, Any]:
    return {"scenario": scenario, "release": rel.id, "parent": rel.parent, "kind": rel.kind,
            "summary": str(rel.meta.get("summary") or ""), "created_at": rel.created_at, "files": _files(harness)}


async def get_harness(request: web.Request) -> web.Response:
    scenario = _scenario(request)
    rel, harness = await _harness_of(request, scenario)
    return json_response(harness_json(scenario.name, rel, harness), headers={RELEASE_HEADER: rel.id})


async def releases(request: web.Request) -> web.Response:
    """The harness versions (releases that changed it), newest first, and the one serving now."""
    scenario = _scenario(request)
    chain = request.app[CHAIN]
    user = access.user(request, scenario)
    serving_id = _serving(request, scenario, user)
    line = user if user is not None and request.app[RECONCILER].users.why(scenario.name, user) is None else None

    def listing() -> tuple[list[dict[str, Any]], str | None]:
        versions = harness_versions(chain, scenario.name, line)  # a line set aside: the shared one serves
        serving = chain.get(serving_id) if serving_id else None
        current = _version(chain, serving).id if serving and "harness" in chain.artifacts(serving.id) else None
        return [{"id": r.id, "parent": r.parent, "kind": r.kind, "created_at": r.created_at,
                 "summary": str(r.meta.get("summary") or "")} for r in versions], current

    data, current = await asyncio.to_thread(listing)
    return json_response({"object": "list", "scenario": scenario.name, "current": current, "data": data,
                          **({} if user is None else {"user": user})})


async def install(request: web.Request) -> web.Response:
    """A POSIX sh installer for one agent (`?adapter=`), with the current harness inline."""
    adapter = request.query.get("adapter", "")
    if adapter not in ADAPTERS:
        raise ApiError(400, f"unknown adapter {shown(adapter)}; known adapters: {', '.join(ADAPTERS)}",
                       param="adapter", code="unknown_adapter")
    scenario = _scenario(request)
    rel, harness = await _harness_of(request, scenario)
    base_url = f"{request.scheme}://{request.host}"
    try:
        script = installer(adapter, scenario.name, base_url, harness_json(scenario.name, rel, harness))
    except ValueError as exc:  # e.g. a Host header the script could not quote safely
        raise ApiError(400, f"cannot write an installer: {exc}", code="invalid_request") from None
    return web.Response(text=script, content_type="text/x-shellscript", headers={RELEASE_HEADER: rel.id})
