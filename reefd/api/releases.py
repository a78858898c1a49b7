"""The release chain over HTTP: history, show, diff, and the operator's writes (publish, rollback, promote).

Every write goes through the chain's commit policy (reefd/commit/chain.py `commit`, via reefd/loop.py `commit`, which
then hot-swaps): a compare-and-swap on the scenario's head, so a 409 means nothing was written, and the answer's
`serving` is what new requests get. Knows the admin wire shapes; the chain and the reconciler do the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Any

from aiohttp import web

from reefd import engines, loop
from reefd.api import access
from reefd.api.errors import ApiError, json_response, read_json, shown, shown_text
from reefd.commit import chain as releases
from reefd.commit import trials as canary
from reefd.commit.adapters import InvalidAdapter, base_linear_shapes, check_adapter
from reefd.commit.chain import Candidate, Release, TrialRefused, UnknownRelease, validate_name
from reefd.commit.chain_types import WeightsRefused
from reefd.commit.weights import InvalidWeights, check_weights, weight_files
from reefd.loop import CHAIN, REGISTRY
from reefd.serve.scenarios import Scenario

MAX_UPLOAD = {"adapter": 8 << 30, "weights": 512 << 30}  # upload limits (adapters are megabytes, weights gigabytes)
PUBLISH_KINDS = ("adapter", "weights")


def release_json(rel: Release) -> dict[str, Any]:
    return {"id": rel.id, "scenario": rel.scenario, **({"user": rel.user} if rel.user is not None else {}),
            "parent": rel.parent, "kind": rel.kind, "seq": rel.seq, "created_at": rel.created_at,
            "commit": rel.commit, "meta": rel.meta, "status": rel.status}


def _scenario(request: web.Request) -> Scenario:
    return access.scenario(request, validate_name(request.match_info["name"]), param="name")


def _release_id(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field}: must be a release id such as r3-1a2b3c4", param=field, code="invalid_request")
    return value.removeprefix("release/")


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"{field}: must be true or false", param=field, code="invalid_request")
    return value


async def _plan(request: web.Request, scenario: Scenario, cand: Candidate) -> releases.Plan:
    """What committing `cand` would do now: refused (pinned, no release yet, a stale expected head, an unknown
    target) before any work is done, such as receiving an upload."""
    return await asyncio.to_thread(releases.plan, request.app[CHAIN], scenario.name, cand, pin=scenario.cfg.release.pin)


async def _written(request: web.Request, scenario: Scenario, rel: Release, **extra: Any) -> dict[str, Any]:
    """The answer after a commit (which swapped the engine before returning): the release and what serves (a
    user's line: what serves that user's next turn)."""
    live = request.app[REGISTRY].scenarios.get(scenario.name, scenario)
    if rel.user is not None:
        return {"release": release_json(rel), "user": rel.user,
                "serving": _serving(request, live, rel.user), **extra}
    out = {"release": release_json(rel), "serving": live.release, **extra}
    if live.trial is not None:  # the new head is on trial: a canary serves a share of the sessions, a shadow none
        out["trial"] = {"mode": live.trial.mode, "release": live.trial.binding.release, "share": live.trial.share,
                        "stable": live.trial.stable}
    if live.error:
        out["error"] = live.error
    return out


def _serving(request: web.Request, scenario: Scenario, user: str | None) -> str | None:
    """What serves a turn of `user` (None: anyone's): their own line's head, else the scenario's release."""
    return request.app[loop.RECONCILER].users.serving(scenario, user) if user is not None else scenario.release


# ---------------------------------------------------------------- reads


async def history(request: web.Request) -> web.Response:
    """A scenario's releases, newest first; `?all=1` adds the rejected candidates. `?user=NAME` (a user's token:
    its own) gives that user's line, then the shared releases it forked from; a user with no line of their own
    is on the shared line (`own_line: false`)."""
    scenario = _scenario(request)
    user = access.line_of(request, scenario)
    chain = request.app[CHAIN]
    everything = request.query.get("all", "") in ("1", "true", "yes")
    found = await asyncio.to_thread(chain.history, scenario.name, include_rejected=everything, user=user)
    own = user is None or bool(found)
    if not own:
        found = await asyncio.to_thread(chain.history, scenario.name, include_rejected=everything)
    head = next((r.id for r in found if r.status == "released"), None)
    whose = {} if user is None else {"user": user, "own_line": own}
    return json_response({"object": "list", "scenario": scenario.name, **whose,
                          "serving": _serving(request, scenario, user),
                          "head": head, "declared": scenario.cfg.release.pin,
                          "data": [release_json(r) for r in found]})


async def show(request: web.Request) -> web.Response:
    chain = request.app[CHAIN]
    release_id = request.match_info["release"]
    rel = await asyncio.to_thread(chain.get, release_id, include_rejected=True)
    if not access.covers(request, rel.scenario) or not access.sees_line(request, rel.user):
        raise UnknownRelease(release_id)
    files = await asyncio.to_thread(chain.files, release_id)
    return json_response({**release_json(rel), "files": files})


MAX_LINEAGE_DEPTH = 1000
MAX_HARNESS_DIFF = 256 << 10  # characters of a lineage's harness diff; `reefctl diff PARENT RELEASE` has it all
_REPORT_FIELDS = ("report_id", "score", "feedback", "source", "created_at")


async def lineage(request: web.Request) -> web.Response:
    """What a release learned from, and its ancestors' up to `?depth=` (default 1; `all`: back to the base):
    parent, kind, recipe, the job with its parameters and trainer figures, gate verdict, canary evidence, the
    proposer's answer, mutations and harness diff, and each record it was trained on with the reports and
    judgments on it. One store read per record."""
    raw = request.query.get("depth", "1")
    try:
        depth = MAX_LINEAGE_DEPTH if raw == "all" else int(raw)
    except ValueError:
        depth = 0
    if not 1 <= depth <= MAX_LINEAGE_DEPTH:
        raise ApiError(400, f"depth: {shown(raw)} is not 'all' or an integer from 1 to {MAX_LINEAGE_DEPTH}",
                       param="depth", code="invalid_request")
    chain, store = request.app[CHAIN], request.app[loop.RECORDS]
    release_id = request.match_info["release"]
    first = await asyncio.to_thread(chain.get, release_id, include_rejected=True)
    if not access.covers(request, first.scenario) or not access.sees_line(request, first.user):
        raise UnknownRelease(release_id)

    def walk() -> list[dict[str, Any]]:
        out, rel = [], first
        while True:
            out.append(_explained(rel, store, chain))
            if rel.parent is None or len(out) >= depth:
                return out
            rel = chain.get(rel.parent, include_rejected=True)

    releases_ = await asyncio.to_thread(walk)
    jobs = request.app[loop.SCHEDULER].jobs.jobs
    for entry in releases_:
        job = jobs.get(str(entry["job"])) if entry["job"] else None
        entry["job"] = job.as_json() if job is not None else entry["job"]
    return json_response({"object": "reef.lineage", "release": release_id, "depth": len(releases_),
                          "releases": releases_})


def _explained(rel: Release, store: Any, chain: releases.ReleaseChain) -> dict[str, Any]:
    """One release of a lineage (blocking): what its release.json says, its records looked up one by one, and
    its harness diff."""
    meta = rel.meta
    learned = []
    for receipt in meta.get("receipts") or []:
        record = store.get_record(str(receipt))
        learned.append({"receipt": receipt, "deleted": record is None, "record": f"/reef/records/{receipt}",
                        "user": (record or {}).get("user"),
                        "reports": [{k: r.get(k) for k in _REPORT_FIELDS} for r in (record or {}).get("reports", [])]})
    return {"id": rel.id, "scenario": rel.scenario, "parent": rel.parent, "kind": rel.kind, "status": rel.status,
            "created_at": rel.created_at, "recipe": meta.get("source"), "summary": meta.get("summary"),
            "job": meta.get("job"), "params": meta.get("params"), "metrics": meta.get("metrics"),
            "gate": meta.get("gate"), "canary": meta.get("canary"), "proposal": meta.get("proposal"),
            "mutations": meta.get("mutations"), "harness_diff": _harness_diff(rel, chain), "learned_from": learned,
            "users": meta.get("users") or ([rel.user] if rel.user is not None else [])}


def _harness_diff(rel: Release, chain: releases.ReleaseChain) -> str | None:
    """The unified diff of the harness files from the release's parent to it; None when they are the same."""
    if rel.parent is None or chain.artifacts(rel.id).get("harness") == chain.artifacts(rel.parent).get("harness"):
        return None
    found = chain.diff(rel.parent, rel.id)
    paths = sorted(p for key in ("added", "removed", "changed") for p in found[key] if p.startswith("harness/"))
    text = "".join(found["text"].get(p, f"Binary files a/{p} and b/{p} differ\n") for p in paths)
    if len(text) > MAX_HARNESS_DIFF:
        text = text[:MAX_HARNESS_DIFF] + f"\n[... cut; reefctl diff {rel.parent} {rel.id} shows all]\n"
    return text


async def diff(request: web.Request) -> web.Response:
    a, b = request.query.get("a"), request.query.get("b")
    if not a or not b:
        raise ApiError(400, "diff needs two releases: ?a=RELEASE&b=RELEASE", code="invalid_request",
                       param="a" if not a else "b")
    chain = request.app[CHAIN]
    for release_id in (a, b):
        rel = await asyncio.to_thread(chain.get, release_id, include_rejected=True)
        if not access.covers(request, rel.scenario) or not access.sees_line(request, rel.user):
            raise UnknownRelease(release_id)
    out = await asyncio.to_thread(chain.diff, a, b)
    return json_response({"a": a, "b": b, **out})


# ---------------------------------------------------------------- writes


async def _copy_release(request: web.Request, kind: str, target_field: str, summary: str) -> web.Response:
    """Rollback or promote: append a release carrying another release's tree, by compare-and-swap on the head
    named (`expected_head`) or else the head read here, since the target was chosen against it."""
    scenario = _scenario(request)
    body = await read_json(request)
    to = _release_id(body.get(target_field), target_field)
    if kind == "promote" and to is None:
        raise ApiError(400, "release: required (the release or candidate to promote)", param="release",
                       code="invalid_request")
    dry_run = _flag(body.get("dry_run", False), "dry_run")
    expected = _release_id(body.get("expected_head"), "expected_head")
    user = access.line_of(request, scenario, body.get("user"))
    cand = Candidate(kind, {}, target=to, built_on=expected, exact=expected is not None, user=user)
    plan = await _plan(request, scenario, cand)
    assert plan.head is not None and plan.target is not None
    trial = canary.active(scenario.cfg.release, plan.head) if user is None else None
    if kind == "rollback" and to is None and trial is not None:  # a plain rollback of a trial: to its stable release
        plan = releases.Plan(plan.head, await asyncio.to_thread(request.app[CHAIN].target, scenario.name, trial.stable))
    assert plan.head is not None and plan.target is not None
    if dry_run:
        return json_response({"dry_run": True, "release": None, "from": plan.head.id, "to": plan.target.id,
                              **({"user": user} if user is not None else {}),
                              "serving": _serving(request, scenario, user)})
    meta = {"summary": f"{summary} {plan.target.id}"} if kind == "promote" else \
        {"source": "reefctl", "summary": f"{summary} {plan.target.id}"}
    rel = await loop.commit(request.app, scenario, dataclasses.replace(
        cand, meta=meta, target=plan.target.id, built_on=plan.head.id, exact=True))
    return json_response({"dry_run": False, "from": rel.parent, "to": plan.target.id,
                          **await _written(request, scenario, rel)})


async def rollback(request: web.Request) -> web.Response:
    """Append a release carrying an older release's tree (default: the head's parent)."""
    return await _copy_release(request, "rollback", "to", "rollback to")


async def promote(request: web.Request) -> web.Response:
    """Append a release carrying the tree of an older release or of a rejected candidate."""
    return await _copy_release(request, "promote", "release", "promote")


async def publish(request: web.Request) -> web.Response:
    """Publish an artifact uploaded as a tar of its folder (`?kind=adapter`, or `weights`: a full HF model
    folder): validated against the scenario's base model first; a mismatch publishes nothing. An adapter is
    taken as trained on the weights the head serves, and says so in its release."""
    scenario = _scenario(request)
    kind = request.query.get("kind", "adapter")
    if kind not in PUBLISH_KINDS:
        raise ApiError(400, f"kind: {shown(kind)} cannot be published here (supported: {', '.join(PUBLISH_KINDS)})",
                       param="kind", code="invalid_request")
    expected = _release_id(request.query.get("expected_head") or None, "expected_head")
    user = access.line_of(request, scenario)
    if user is not None and kind != "adapter":
        raise ApiError(400, "kind: a user's line takes adapters (full weights serve everyone on the engine)",
                       param="kind", code="invalid_request")
    cand = Candidate(kind, {"source": "publish", "summary": request.query.get("summary", "")}, built_on=expected,
                     exact=expected is not None, user=user)
    plan = await _plan(request, scenario, cand)  # refused (pinned, a stale expected head) before the upload
    code = "invalid_weights" if kind == "weights" else "invalid_adapter"
    if engines.kind_config(scenario.cfg.model.engine).remote:
        what = "full weights" if kind == "weights" else "LoRA adapters"
        raise ApiError(400, f"scenario {scenario.name!r} is served by an upstream provider, which cannot "
                       f"serve {what}", code=code)
    if kind == "weights":
        await _refuse_weights(request, scenario)
    model_dir = scenario.engine.model_folder()
    if model_dir is None:
        raise ApiError(503, f"scenario {scenario.name!r}: the model is still being prepared; retry shortly",
                       code="engine_unavailable", headers={"Retry-After": "5"})
    chain = request.app[CHAIN]
    try:  # the most an artifact of this base model can unpack to: anything bigger is refused before unpacking
        cap = await asyncio.to_thread(unpacked_cap, kind, model_dir)
    except (InvalidAdapter, InvalidWeights, OSError) as exc:
        raise ApiError(503, f"scenario {scenario.name!r}: the base model cannot be read ({exc})",
                       code="engine_unavailable") from None
    tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="upload-", dir=chain.path / "lfs" / "tmp"))
    try:
        folder = await _receive_tar(request, tmp, code, cap)
        try:
            check = check_weights if kind == "weights" else check_adapter
            warnings = await asyncio.to_thread(check, folder, model_dir)
        except (InvalidAdapter, InvalidWeights) as exc:
            problem = str(exc).replace(f"{folder}/", "").replace(str(folder), f"the {kind} folder")
            raise ApiError(400, f"not published: {problem}", code=code) from None
        base = (await asyncio.to_thread(chain.history, scenario.name))[-1]
        meta = {**cand.meta, "base_identity": base.meta.get("identity"), "warnings": warnings}
        if kind == "adapter" and plan.head is not None:
            meta["weights"] = await asyncio.to_thread(chain.weights, plan.head.id)
        rel = await loop.commit(request.app, scenario, dataclasses.replace(cand, meta=meta, artifact=folder))
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    return json_response(await _written(request, scenario, rel, warnings=warnings), status=201)


async def _refuse_weights(request: web.Request, scenario: Scenario) -> None:
    """Full weights the scenario cannot take, refused before the upload: its engine serves other scenarios too, it
    puts releases on a trial its replicas cannot host, or its engine cannot swap to them (WeightsRefused; a
    release keeps its base model's config, so the model folder tells)."""
    sharing = [n for n in request.app[REGISTRY].sharing(scenario.engine) if n != scenario.name]
    if sharing:
        raise ApiError(409, f"scenario {scenario.name!r} shares its model's engine with {', '.join(sharing)}: full "
                       "weights would change their answers too; give it a model of its own (another model.name)",
                       code="engine_shared")
    mode = canary.declared_mode(scenario.cfg.release)
    if mode is not None and scenario.cfg.release.pin is None and \
            (replicas := engines.trial_replicas(scenario.engine)) < 2:
        raise TrialRefused(scenario.name, mode, replicas)
    model_dir = scenario.engine.model_folder()
    if model_dir is not None and (why := await asyncio.to_thread(scenario.weights_refusal, model_dir)) is not None:
        raise WeightsRefused(scenario.name, why)


async def _receive_tar(request: web.Request, tmp: Path, code: str, cap: int) -> Path:
    """Stream the body to disk (up to MAX_UPLOAD), then unpack regular files and folders only, at most `cap`
    bytes of them."""
    limit = MAX_UPLOAD["weights" if code == "invalid_weights" else "adapter"]  # the kind's, told by its code
    ctype = request.content_type
    if ctype not in ("application/x-tar", "application/gzip", "application/x-gzip"):
        raise ApiError(415, f"send the artifact folder as application/x-tar (or application/gzip), not {shown(ctype)}",
                       code="invalid_request")
    archive, size = tmp / "upload.tar", 0
    with archive.open("wb") as out:
        async for chunk in request.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the upload exceeds {limit >> 30} GiB", code="invalid_request")
            await asyncio.to_thread(out.write, chunk)
    folder = tmp / "artifact"
    folder.mkdir()
    await asyncio.to_thread(_unpack, archive, folder, code, min(limit, cap))
    with contextlib.suppress(OSError):
        archive.unlink()
    return folder


MAX_MEMBER_PARTS = 32  # folders deep, in an artifact (HF folders are one or two)
MAX_MEMBER_NAME = 1024  # characters of a member's path
EXTRA_FILES = 64 << 20  # what an artifact may hold beside its tensors: configs, tokenizer, README


def unpacked_cap(kind: str, model_dir: Path) -> int:
    """The most bytes an artifact for the base model in `model_dir` can unpack to.

    An adapter of any rank on every Linear layer holds at most r x (in + out) values per layer with r <= min(in,
    out), 8 bytes each at most; full weights are at most the base's tensors at 4 bytes per 2 (bf16 sent as fp32).
    Plus room for the small files beside them.
    """
    if kind == "adapter":
        tensors = sum(min(o, i) * (o + i) * 8 for o, i in base_linear_shapes(model_dir).values())
    else:
        tensors = 2 * sum(f.stat().st_size for f in weight_files(model_dir))
    return tensors + EXTRA_FILES


def _unpack(archive: Path, dest: Path, code: str, cap: int) -> None:
    """Check every member while reading the archive, stopping at the first bad one or once the members add up
    to more than `cap` (a small compressed upload may unpack to far more: it is never unpacked then)."""
    total = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for m in tar:
                name = shown_text(m.name, 120)
                parts = Path(m.name).parts
                if not (m.isfile() or m.isdir()):
                    raise ApiError(400, f"{name}: only regular files and folders may be uploaded "
                                   "(no links or devices)", code=code)
                if Path(m.name).is_absolute() or ".." in parts or "\0" in m.name:
                    raise ApiError(400, f"{shown(m.name, 120)}: archive paths must stay inside the artifact folder",
                                   code=code)
                if len(parts) > MAX_MEMBER_PARTS or len(m.name) > MAX_MEMBER_NAME:
                    raise ApiError(400, f"{name}: archive paths may be at most {MAX_MEMBER_PARTS} folders deep and "
                                   f"{MAX_MEMBER_NAME} characters long", code=code)
                total += m.size
                if total > cap:
                    raise ApiError(413, f"the artifact unpacks to more than {_size(cap)}, the most an artifact "
                                   "for this base model can hold; nothing was unpacked", code="invalid_request")
            tar.extractall(dest, members=tar.getmembers(), filter="data")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        problem = str(exc).replace(str(dest), "the artifact folder").replace(str(archive), "the upload")
        raise ApiError(400, f"not published: the upload is not a readable tar archive ({shown_text(problem)})",
                       code=code) from None


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
