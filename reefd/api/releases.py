"""The release chain over HTTP: history, show, diff, and the operator's writes (publish, rollback, promote).

Every write is a compare-and-swap on the scenario's head: a 409 means nothing was written. After a
write the reconciler swaps the engine to the new head before the answer goes out, so the answer's
`serving` is what new requests get. Knows the admin wire shapes; the chain and the reconciler do the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from reefd.adapters import InvalidAdapter, check_adapter
from reefd.api.errors import ApiError, json_response, read_json
from reefd.api.keys import CHAIN, REGISTRY
from reefd.releases import (
    HeadConflict,
    InvalidName,
    Release,
    ReleaseChain,
    UnknownRelease,
    WrongScenario,
    validate_name,
)
from reefd.scenarios import Scenario

MAX_UPLOAD = 8 << 30  # an artifact upload's size limit (LoRA adapters are megabytes; this leaves room)
PUBLISH_KINDS = ("adapter",)


def release_json(rel: Release) -> dict[str, Any]:
    return {"id": rel.id, "scenario": rel.scenario, "parent": rel.parent, "kind": rel.kind, "seq": rel.seq,
            "created_at": rel.created_at, "commit": rel.commit, "meta": rel.meta, "status": rel.status}


def _scenario(request: web.Request) -> Scenario:
    name = request.match_info["name"]
    try:
        validate_name(name)
    except InvalidName:
        raise ApiError(400, f"{name!r} is not a scenario name (1-64 letters, digits, '.', '_' or '-'; no '..')",
                       code="invalid_scenario_name", param="name") from None
    return request.app[REGISTRY].get(name)


def _unknown(release_id: object) -> ApiError:
    return ApiError(404, f"no release {release_id!r}", code="release_not_found")


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A chain call off the event loop, its errors turned into admin API errors."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except HeadConflict as exc:
        raise ApiError(409, f"the head of {exc.scenario!r} is {exc.actual}, not {exc.expected}: "
                       "another release was published meanwhile; nothing was written",
                       code="head_conflict", param="expected_head") from None
    except WrongScenario as exc:
        raise ApiError(400, str(exc), code="wrong_scenario") from None
    except UnknownRelease as exc:
        raise ApiError(404, str(exc.args[0]) if exc.args and " " in str(exc.args[0]) else
                       f"no release {exc.args[0] if exc.args else ''!r}", code="release_not_found") from None


def _writable(scenario: Scenario) -> None:
    pin = scenario.cfg.release.pin
    if pin is not None:
        raise ApiError(409, f"scenario {scenario.name!r} is pinned to {pin} by its file (release.pin); "
                       "set release.pin: null and reload reefd before publishing, rolling back or promoting",
                       code="scenario_pinned")


def _release_id(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field}: must be a release id such as r3-1a2b3c4", param=field,
                       code="invalid_request")
    return value.removeprefix("release/")


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"{field}: must be true or false", param=field, code="invalid_request")
    return value


async def _expected_head(chain: ReleaseChain, scenario: Scenario, given: str | None) -> Release:
    head = await _call(chain.head, scenario.name)
    if head is None:
        raise ApiError(503, f"scenario {scenario.name!r} has no base release yet; retry shortly",
                       code="engine_unavailable", headers={"Retry-After": "2"})
    if given is not None and given != head.id:
        raise ApiError(409, f"the head of {scenario.name!r} is {head.id}, not {given}; nothing was written",
                       code="head_conflict", param="expected_head")
    return head


async def _written(request: web.Request, scenario: Scenario, rel: Release, **extra: Any) -> dict[str, Any]:
    """Swap the engine to the new head, then say what serves."""
    await request.app[REGISTRY].reconciler.reconcile(scenario)
    out = {"release": release_json(rel), "serving": scenario.release, **extra}
    if scenario.error:
        out["error"] = scenario.error
    return out


# ---------------------------------------------------------------- reads


async def history(request: web.Request) -> web.Response:
    """A scenario's releases, newest first; `?all=1` adds the rejected candidates."""
    scenario = _scenario(request)
    chain = request.app[CHAIN]
    everything = request.query.get("all", "") in ("1", "true", "yes")
    releases = await _call(chain.history, scenario.name, include_rejected=everything)
    head = next((r.id for r in releases if r.status == "released"), None)
    return json_response({"object": "list", "scenario": scenario.name, "serving": scenario.release,
                          "head": head, "declared": scenario.cfg.release.pin,
                          "data": [release_json(r) for r in releases]})


async def show(request: web.Request) -> web.Response:
    chain = request.app[CHAIN]
    release_id = request.match_info["release"]
    try:
        rel = await asyncio.to_thread(chain.get, release_id, include_rejected=True)
        files = await asyncio.to_thread(chain.files, release_id)
    except UnknownRelease:
        raise _unknown(release_id) from None
    return json_response({**release_json(rel), "files": files})


async def diff(request: web.Request) -> web.Response:
    a, b = request.query.get("a"), request.query.get("b")
    if not a or not b:
        raise ApiError(400, "diff needs two releases: ?a=RELEASE&b=RELEASE", code="invalid_request",
                       param="a" if not a else "b")
    try:
        out = await asyncio.to_thread(request.app[CHAIN].diff, a, b)
    except UnknownRelease as exc:
        raise _unknown(exc.args[0] if exc.args else a) from None
    return json_response({"a": a, "b": b, **out})


# ---------------------------------------------------------------- writes


async def rollback(request: web.Request) -> web.Response:
    """Append a release carrying an older release's tree (default: the head's parent)."""
    scenario = _scenario(request)
    body = await read_json(request)
    to = _release_id(body.get("to"), "to")
    dry_run = _flag(body.get("dry_run", False), "dry_run")
    _writable(scenario)
    chain = request.app[CHAIN]
    head = await _expected_head(chain, scenario, _release_id(body.get("expected_head"), "expected_head"))
    if to is None:
        if head.parent is None:
            raise ApiError(400, f"{head.id} is the first release of {scenario.name!r}; there is nothing to "
                           "roll back to", code="invalid_request", param="to")
        to = head.parent
    target = await _call(chain.target, scenario.name, to)
    if dry_run:
        return json_response({"dry_run": True, "release": None, "from": head.id, "to": target.id,
                              "serving": scenario.release})
    rel = await _call(chain.rollback, scenario.name, target.id, expected_head=head.id,
                      meta={"source": "reefctl", "summary": f"rollback to {target.id}"})
    return json_response({"dry_run": False, "from": head.id, "to": target.id,
                          **await _written(request, scenario, rel)})


async def promote(request: web.Request) -> web.Response:
    """Append a release carrying the tree of an older release or of a rejected candidate."""
    scenario = _scenario(request)
    body = await read_json(request)
    to = _release_id(body.get("release"), "release")
    if to is None:
        raise ApiError(400, "release: required (the release or candidate to promote)", param="release",
                       code="invalid_request")
    dry_run = _flag(body.get("dry_run", False), "dry_run")
    _writable(scenario)
    chain = request.app[CHAIN]
    head = await _expected_head(chain, scenario, _release_id(body.get("expected_head"), "expected_head"))
    target = await _call(chain.target, scenario.name, to, include_rejected=True)
    if dry_run:
        return json_response({"dry_run": True, "release": None, "from": head.id, "to": target.id,
                              "serving": scenario.release})
    rel = await _call(chain.promote, scenario.name, target.id, expected_head=head.id,
                      meta={"summary": f"promote {target.id}"})
    return json_response({"dry_run": False, "from": head.id, "to": target.id,
                          **await _written(request, scenario, rel)})


async def publish(request: web.Request) -> web.Response:
    """Publish an artifact uploaded as a tar of its folder (`?kind=adapter`): validated against the
    scenario's base model first; a mismatch publishes nothing."""
    scenario = _scenario(request)
    kind = request.query.get("kind", "adapter")
    if kind not in PUBLISH_KINDS:
        raise ApiError(400, f"kind: {kind!r} cannot be published here (supported: {', '.join(PUBLISH_KINDS)})",
                       param="kind", code="invalid_request")
    expected = _release_id(request.query.get("expected_head") or None, "expected_head")
    summary = request.query.get("summary", "")
    _writable(scenario)
    if scenario.cfg.model.engine == "upstream":
        raise ApiError(400, f"scenario {scenario.name!r} is served by an upstream provider, which cannot "
                       "serve LoRA adapters", code="invalid_adapter")
    model_dir = scenario.engine.model_folder()
    if model_dir is None:
        raise ApiError(503, f"scenario {scenario.name!r}: the model is still being prepared; retry shortly",
                       code="engine_unavailable", headers={"Retry-After": "5"})
    chain = request.app[CHAIN]
    tmp = Path(tempfile.mkdtemp(prefix="upload-", dir=chain.path / "lfs" / "tmp"))
    try:
        folder = await _receive_tar(request, tmp)
        try:
            warnings = await asyncio.to_thread(check_adapter, folder, model_dir)
        except InvalidAdapter as exc:
            problem = str(exc).replace(f"{folder}/", "").replace(str(folder), "the adapter folder")
            raise ApiError(400, f"not published: {problem}", code="invalid_adapter") from None
        head = await _expected_head(chain, scenario, expected)
        base = (await _call(chain.history, scenario.name))[-1]
        meta = {"source": "publish", "summary": summary, "base_identity": base.meta.get("identity"),
                "warnings": warnings}
        rebase = expected is None and scenario.cfg.release.on_conflict == "rebase"
        rel = await _call(_append, chain, scenario.name, head, folder, meta, rebase)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    return json_response(await _written(request, scenario, rel, warnings=warnings), status=201)


def _append(chain: ReleaseChain, scenario: str, head: Release, folder: Path, meta: dict[str, Any],
            rebase: bool, attempts: int = 5) -> Release:
    """Publish on `head`. When another writer moved the head first: with `rebase`, the same adapter goes on
    the new head (a few times at most); else HeadConflict, and nothing was written."""
    for attempt in range(attempts):
        try:
            return chain.publish(scenario, expected_head=head.id, kind="adapter", artifact_dir=folder,
                                 meta={**meta, "built_on": head.id})
        except HeadConflict:
            moved = chain.head(scenario)
            if not rebase or moved is None or attempt == attempts - 1:
                raise
            head = moved
    raise AssertionError("unreachable")


async def _receive_tar(request: web.Request, tmp: Path) -> Path:
    """Stream the body to disk (up to MAX_UPLOAD), then unpack regular files and folders only."""
    ctype = request.content_type
    if ctype not in ("application/x-tar", "application/gzip", "application/x-gzip"):
        raise ApiError(415, f"send the artifact folder as application/x-tar (or application/gzip), not {ctype!r}",
                       code="invalid_request")
    archive, size = tmp / "upload.tar", 0
    with archive.open("wb") as out:
        async for chunk in request.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > MAX_UPLOAD:
                raise ApiError(413, f"the upload exceeds {MAX_UPLOAD >> 30} GiB", code="invalid_request")
            out.write(chunk)
    folder = tmp / "artifact"
    folder.mkdir()
    await asyncio.to_thread(_unpack, archive, folder)
    with contextlib.suppress(OSError):
        archive.unlink()
    return folder


def _unpack(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for m in members:
                parts = Path(m.name).parts
                if not (m.isfile() or m.isdir()):
                    raise ApiError(400, f"{m.name}: only regular files and folders may be uploaded "
                                   "(no links or devices)", code="invalid_adapter")
                if Path(m.name).is_absolute() or ".." in parts or "\0" in m.name:
                    raise ApiError(400, f"{m.name!r}: archive paths must stay inside the artifact folder",
                                   code="invalid_adapter")
            if sum(m.size for m in members) > MAX_UPLOAD:
                raise ApiError(413, f"the unpacked artifact exceeds {MAX_UPLOAD >> 30} GiB", code="invalid_request")
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ApiError(400, f"not published: the upload is not a readable tar archive ({exc})",
                       code="invalid_adapter") from None
