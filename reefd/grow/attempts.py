"""Grids of scored attempts, for search recipes (TTT-Discover): the step a client works on, its coordinates, the
archive of states the steps grow (one JSON file per scenario, STATE/attempts/NAME.json), and the job each full grid
becomes. Knows nothing about HTTP or tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from reefd.grow.job_store import Job, JobStore
from reefd.grow.recipes import engine_tokens
from reefd.observe.records import ClaimTaken, RecordStore
from reefd.ops.files import write_json
from reefd.serve.scenarios import Registry, Scenario

log = logging.getLogger("reefd.grow.attempts")

COORDINATES = ("step", "group", "rollout")
RETRY_S = 30.0  # a failed grid job is submitted again when a client asks for the next step this long after


class AttemptError(Exception):
    """A request about attempts that cannot be taken: `status` (4xx), a one-line message naming `param`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_attempt"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@runtime_checkable
class Search(Protocol):
    """What a search recipe declares: a grid of attempts, and what this module asks of it (e.g. ttt-discover)."""

    grid: Any  # .groups, .rollouts, .size
    puct_c: float
    trains: bool  # False: search only; a full grid updates the archive and no job runs
    sampling: dict[str, Any]

    def new_archive(self) -> Any: ...

    def load_archive(self, doc: dict[str, Any]) -> Any: ...

    def messages(self, state: str, score: float | None) -> list[dict[str, Any]]: ...

    def summarize(self, rewards: list[float]) -> dict[str, Any]: ...


def claim(step: int, group: int, rollout: int) -> str:
    return f"grid/{step:08d}/{group}/{rollout}"


Submit = Callable[[str, str], Awaitable[Job]]


class Attempts:
    """The search state of every scenario whose recipe has a grid. A step's life: `plan` opens it (G parents chosen
    by PUCT, pinned to the serving release) → reports claim its coordinates (`report`: the first at a coordinate
    keeps it, in the report's LMDB transaction) → the last one closes it: its attempts join the archive and the
    scheduler gets a job (a grid from two releases is discarded; one whose groups all scored alike is dropped) →
    the job's release serves, and the next `plan` starts from it."""

    def __init__(self, root: Path, registry: Registry, store: RecordStore, jobs: JobStore, submit: Submit) -> None:
        self.root, self.registry, self.store, self.jobs, self.submit = root, registry, store, jobs, submit
        root.mkdir(parents=True, exist_ok=True)
        self._docs: dict[str, dict[str, Any]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------ state

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _search(self, name: str) -> tuple[Scenario, Search]:
        scenario = self.registry.scenarios.get(name)
        search = scenario.recipe if scenario is not None else None
        if scenario is None or not isinstance(search, Search):
            raise AttemptError(404, f"scenario {name!r} has no search recipe (one with a grid of attempts, such as "
                                    "ttt-discover)", param="name", code="not_a_search")
        return scenario, search

    def _doc(self, name: str, search: Search) -> dict[str, Any]:
        doc = self._docs.get(name)
        if doc is None:
            path = self.root / f"{name}.json"
            try:
                doc = json.loads(path.read_text()) if path.is_file() else None
            except (OSError, ValueError) as exc:  # kept aside for inspection; the search starts over
                aside = path.with_name(f"{name}.json.bad-{int(time.time())}")
                path.replace(aside)
                log.error("%s: the attempts file is unreadable (%s); moved to %s, starting a new archive", name,
                          exc, aside)
                doc = None
            if doc is None:
                doc = {"scenario": name, "step": 0, "open": None, "pending": None,
                       "archive": search.new_archive().as_json()}
            self._docs[name] = doc
        return doc

    def _save(self, name: str) -> None:
        write_json(self.root / f"{name}.json", self._docs[name])

    async def start(self) -> None:
        """After a restart: a grid that was being trained gets its job again (the jobs of a stopped reefd fail)."""
        for name, scenario in self.registry.scenarios.items():
            if isinstance(scenario.recipe, Search) and (self.root / f"{name}.json").is_file():
                async with self._lock(name):
                    scenario, search = self._search(name)
                    doc = await asyncio.to_thread(self._doc, name, search)
                    if doc["open"] is not None:  # stopped after the grid's last report, before it closed
                        await self._maybe_close(name, search, doc)
                    await self._refresh(name, scenario, search, retry_after=0.0)

    # ------------------------------------------------------------ the next step

    async def plan(self, name: str) -> tuple[int, dict[str, Any]]:
        """(200, the open step's plan) — opening one if none is — or (202, why the client must wait)."""
        async with self._lock(name):
            scenario, search = self._search(name)
            doc = self._doc(name, search)
            await self._refresh(name, scenario, search)
            plan = doc["open"]
            if scenario.release is None:  # starting, or reloading: no release serves yet, so none changed
                return 202, {"object": "reef.attempts.wait", "scenario": name, "status": "starting",
                             "step": plan["step"] if plan else None, "error": scenario.error, "retry_after_s": 2}
            if plan is not None and await self._maybe_close(name, search, doc):
                plan = None  # its last report was stored, but reefd stopped before it closed the step
            if plan is not None and plan["release"] != scenario.release:
                await self._discard(name, doc, search, f"the serving release changed from {plan['release']} to "
                                                       f"{scenario.release} during the step")
                plan = None
            if plan is not None:
                return 200, plan
            if doc["pending"] is not None:
                pending = doc["pending"]
                job = self.jobs.jobs.get(pending.get("job") or "")
                return 202, {"object": "reef.attempts.wait", "scenario": name, "status": "training",
                             "step": pending["step"], "job": pending.get("job"),
                             "job_state": job.state if job else None, "error": pending.get("error"),
                             "retry_after_s": 2 if job is not None and job.state in ("queued", "running") else 10}
            archive = search.load_archive(doc["archive"])
            chosen = archive.select(search.grid.groups, search.puct_c)
            step = int(doc["step"])
            doc["open"] = {
                "object": "reef.attempts.step", "scenario": name, "step": step, "release": scenario.release,
                "groups": search.grid.groups, "rollouts": search.grid.rollouts, "sampling": dict(search.sampling),
                "created_at": time.time(),
                "parents": [{"group": g, "id": s.node.id, "state": s.node.state, "score": s.node.score,
                             "puct": {"score": _finite(s.score), "q": _finite(s.q), "prior": s.prior,
                                      "bonus": s.bonus, "visits": s.node.visits},
                             "messages": search.messages(s.node.state, s.node.score)}
                            for g, s in enumerate(chosen)]}
            await asyncio.to_thread(self._save, name)
            log.info("%s: step %d opened on %s", name, step, scenario.release)
            return 200, doc["open"]

    # ------------------------------------------------------------ reports

    def handles(self, scenario: Scenario) -> bool:
        return isinstance(scenario.recipe, Search)

    async def report(self, name: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Store a client's report on an attempt: its coordinate checked against the open step and claimed with
        it; the grid's last coordinate closes the step. Returns what put_report returns."""
        async with self._lock(name):
            _, search = self._search(name)
            doc = self._doc(name, search)
            known = body.get("report_id") and await asyncio.to_thread(self.store.get_report, name,
                                                                          str(body["report_id"]))
            if known:
                # a resend: the store answers it (the same report, or a conflict) without a claim
                return await self.store.put_report(name, body)
            step, group, rollout = coordinates(doc, body)
            receipt = body["references"][0]
            record = await asyncio.to_thread(self.store.get_record, str(receipt))
            if record is not None and engine_tokens(record) is None:
                raise AttemptError(400, f"references: {receipt!r} has no generated token ids and logprobs (an empty "
                                        "or failed answer, or not from this scenario's engine): it cannot be an "
                                        "attempt; send the attempt again", param="references")
            try:
                stored = await self.store.put_report(name, body, claims=[claim(step, group, rollout),
                                                                         f"attempt/{receipt}"])
            except ClaimTaken as exc:
                if exc.claim.startswith("grid/"):
                    raise AttemptError(409, f"metadata: step {step} group {group} rollout {rollout} is already "
                                            f"reported by {exc.holder!r}; the first report is kept",
                                       param="metadata", code="duplicate_coordinate") from None
                raise AttemptError(409, f"references: {receipt!r} is already the attempt of report "
                                        f"{exc.holder!r}", param="references", code="duplicate_attempt") from None
            if stored[1]:
                await self._maybe_close(name, search, doc)
            return stored

    # ------------------------------------------------------------ closing a step

    async def _maybe_close(self, name: str, search: Search, doc: dict[str, Any]) -> bool:
        """Close the open step if every coordinate is claimed; whether it did."""
        plan = doc["open"]
        prefix = f"grid/{plan['step']:08d}/"
        claims = await asyncio.to_thread(self.store.claimed, name, prefix)
        if len(claims) < plan["groups"] * plan["rollouts"]:
            return False
        await self._close(name, search, doc, claims)
        return True

    async def _close(self, name: str, search: Search, doc: dict[str, Any], claims: dict[str, str]) -> None:
        plan = doc["open"]
        attempts = await asyncio.to_thread(_attempts, self.store, name, claims)
        releases = sorted({str(a["record"].get("release")) for a in attempts})
        if releases != [plan["release"]]:
            await self._discard(name, doc, search, "its attempts came from releases " + ", ".join(releases)
                                + f" (the step was planned on {plan['release']})", attempts)
            return
        archive = search.load_archive(doc["archive"])
        groups: dict[int, list[dict[str, Any]]] = {}
        for a in attempts:
            groups.setdefault(a["group"], []).append(a)
        parents = {p["group"]: p for p in plan["parents"]}
        children, figures = [], []
        for g in sorted(groups):
            rows = sorted(groups[g], key=lambda a: a["rollout"])
            figures.append({"group": g, "parent": parents[g]["id"], **search.summarize([a["score"] for a in rows])})
            for a in rows:
                children.append({"id": f"s{plan['step']}.{g}.{a['rollout']}", "state": a["state"],
                                 "score": a["score"], "parent": parents[g]["id"], "release": plan["release"],
                                 "step": plan["step"], "receipt": a["receipt"]})
        added = archive.expand([parents[g]["id"] for g in sorted(groups)], children)
        scores = [a["score"] for a in attempts]
        best = archive.best()
        entry = {"step": plan["step"], "release": plan["release"], "attempts": len(attempts),
                 "mean": math.fsum(scores) / len(scores), "max": max(scores), "best_so_far": best.score,
                 "best_state": best.id, "added": added, "betas": [f.get("beta") for f in figures],
                 "dropped": [f["group"] for f in figures if "dropped" in f], "closed_at": time.time()}
        receipts = [a["receipt"] for a in attempts]
        doc["open"], doc["step"] = None, plan["step"] + 1
        if not search.trains or len(entry["dropped"]) == len(figures):
            if search.trains:
                entry.update(state="dropped", reason="every group's rewards are equal: nothing to learn")
            else:
                entry.update(state="searched", reason="search only (recipe.params.train: false)")
            archive.curve.append(entry)
            doc["archive"] = archive.as_json()
            await self.store.mark_consumed(name, receipts, f"{entry['state']} step {plan['step']}")
            await asyncio.to_thread(self._save, name)
            log.info("%s: step %d %s: %s", name, plan["step"], entry["state"], entry["reason"])
            return
        entry["state"] = "training"
        archive.curve.append(entry)
        doc["archive"] = archive.as_json()
        doc["pending"] = {"step": plan["step"], "release": plan["release"], "job": None, "error": None}
        await asyncio.to_thread(self._save, name)
        job = await self.submit(name, "grid")
        doc["pending"]["job"] = job.id
        await asyncio.to_thread(self._save, name)
        log.info("%s: step %d closed (mean %.4g, best so far %s): %s", name, plan["step"], entry["mean"],
                 best.score, job.id)

    async def _discard(self, name: str, doc: dict[str, Any], search: Search, reason: str,
                       attempts: list[dict[str, Any]] | None = None) -> None:
        """The open step is dropped with its attempts (consumed, never trained on); the curve shows why."""
        plan = doc["open"]
        if attempts is None:
            claims = await asyncio.to_thread(self.store.claimed, name, f"grid/{plan['step']:08d}/")
            attempts = await asyncio.to_thread(_attempts, self.store, name, claims)
        receipts = [a["receipt"] for a in attempts if a["receipt"]]
        if receipts:
            await self.store.mark_consumed(name, receipts, f"discarded step {plan['step']}")
        archive = search.load_archive(doc["archive"])
        archive.curve.append({"step": plan["step"], "release": plan["release"], "attempts": len(receipts),
                              "state": "discarded", "reason": reason, "closed_at": time.time()})
        doc["archive"], doc["open"], doc["step"] = archive.as_json(), None, plan["step"] + 1
        await asyncio.to_thread(self._save, name)
        log.warning("%s: step %d discarded: %s", name, plan["step"], reason)

    async def _refresh(self, name: str, scenario: Scenario, search: Search, retry_after: float = RETRY_S) -> None:
        """Settle the step being trained: its job published (or rejected) it, or failed and is submitted again."""
        doc = self._doc(name, search)
        pending = doc.get("pending")
        if pending is None:
            return
        job = self.jobs.jobs.get(pending.get("job") or "")
        if job is not None and job.state in ("queued", "running"):
            return
        if job is not None and job.state in ("published", "rejected", "skipped"):  # skipped: no batch in the grid
            archive = search.load_archive(doc["archive"])
            for entry in archive.curve:
                if entry["step"] == pending["step"] and entry.get("state") == "training":
                    entry.update({"state": "skipped", "job": job.id, "reason": job.error} if job.state == "skipped"
                                 else {"state": "trained" if job.state == "published" else "rejected",
                                       "job": job.id, "produced": job.release})
            doc["archive"], doc["pending"] = archive.as_json(), None
            await asyncio.to_thread(self._save, name)
            if job.state == "skipped":
                log.warning("%s: step %d not trained: %s", name, pending["step"], job.error)
            return
        if job is not None and time.time() - (job.finished_at or 0.0) < retry_after:
            pending["error"] = job.error
            return
        pending["error"] = job.error if job is not None else pending.get("error")
        with contextlib.suppress(KeyError):
            job = await self.submit(name, "grid")
            pending["job"] = job.id
        await asyncio.to_thread(self._save, name)

    # ------------------------------------------------------------ what operators see

    async def describe(self, name: str, top: int = 5) -> dict[str, Any]:
        """The archive: the best state, the best-so-far curve, the open and pending steps, the top states."""
        async with self._lock(name):
            scenario, search = self._search(name)
            doc = self._doc(name, search)
            await self._refresh(name, scenario, search)
            archive = search.load_archive(doc["archive"])
            ranked = archive.puct(search.puct_c)
            states = sorted(archive.scored(), key=lambda n: -(n.score or 0.0))[:top]
            return {"object": "reef.archive", "scenario": name, "step": doc["step"],
                    "open": None if doc["open"] is None else {k: doc["open"][k] for k in ("step", "release",
                                                                                          "groups", "rollouts")},
                    "pending": doc["pending"], "best": archive.best().as_json(), "states": len(archive.nodes),
                    "expansions": archive.total, "top": [n.as_json() for n in states],
                    "next": [{"id": s.node.id, "puct": _finite(s.score)} for s in ranked[:top]],
                    "curve": archive.curve}

    def summary(self, name: str) -> dict[str, Any] | None:
        """A line's worth for `reefctl status` (no I/O beyond the cached file)."""
        doc = self._docs.get(name)
        if doc is None:
            return None
        curve = doc["archive"].get("curve") or []
        scored = [n["score"] for n in doc["archive"]["nodes"] if n.get("score") is not None]
        return {"step": doc["step"], "open": doc["open"] is not None, "training": doc["pending"] is not None,
                "best": max(scored) if scored else None, "closed": len(curve),
                "discarded": sum(1 for e in curve if e.get("state") == "discarded")}


def _attempts(store: RecordStore, name: str, claims: dict[str, str]) -> list[dict[str, Any]]:
    """Each claimed coordinate's attempt: its report's score and state and its record (blocking reads)."""
    out = []
    for key, report_id in claims.items():
        _, _, group, rollout = key.split("/")
        report = store.get_report(name, report_id) or {}
        receipt = (report.get("references") or [""])[0]
        record = store.get_record(receipt) or {}
        meta = report.get("metadata") or {}
        state = meta.get("state")
        if not isinstance(state, str):
            reply = (record.get("messages") or [{}])[-1]
            state = reply.get("content") if isinstance(reply.get("content"), str) else ""
        out.append({"group": int(group), "rollout": int(rollout), "score": float(report.get("score") or 0.0),
                    "state": state, "receipt": receipt, "record": {"release": record.get("release")}})
    return out


def coordinates(doc: dict[str, Any], body: dict[str, Any]) -> tuple[int, int, int]:
    """An attempt's report checked against the open step: its (step, group, rollout)."""
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        raise AttemptError(400, "metadata: required on an attempt's report: {step, group, rollout}", param="metadata")
    values = []
    for key in COORDINATES:
        v = meta.get(key)
        if v is None:
            raise AttemptError(400, f"metadata.{key}: required (an attempt's report carries step, group and "
                                    "rollout)", param=f"metadata.{key}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise AttemptError(400, f"metadata.{key}: {v!r} is not a non-negative integer", param=f"metadata.{key}")
        values.append(v)
    step, group, rollout = values
    score = body.get("score")
    if score is None:
        raise AttemptError(400, "score: required (an attempt's report is its score)", param="score")
    if not isinstance(score, int | float) or isinstance(score, bool) or not math.isfinite(score):
        raise AttemptError(400, f"score: {score!r} is not a finite number", param="score")
    if len(body.get("references") or []) != 1:
        raise AttemptError(400, "references: an attempt's report references exactly one receipt (the attempt)",
                           param="references")
    if "state" in meta and not isinstance(meta["state"], str):
        raise AttemptError(400, "metadata.state: the attempt's resulting state must be a string",
                           param="metadata.state")
    plan = doc["open"]
    current = plan["step"] if plan is not None else int(doc["step"])
    if step > current:
        raise AttemptError(400, f"metadata.step: {step} is ahead of the current step {current}",
                           param="metadata.step", code="step_ahead")
    if plan is None or step < current:
        raise AttemptError(409, f"metadata.step: step {step} is closed"
                                + ("" if plan is not None else
                                   " and no step is open (POST /reef/scenarios/NAME/attempts/next opens one)"),
                           param="metadata.step", code="step_closed")
    if group >= plan["groups"]:
        raise AttemptError(400, f"metadata.group: {group} is outside the step's {plan['groups']} groups "
                                f"(0..{plan['groups'] - 1})", param="metadata.group")
    if rollout >= plan["rollouts"]:
        raise AttemptError(400, f"metadata.rollout: {rollout} is outside the step's {plan['rollouts']} "
                                f"rollouts (0..{plan['rollouts'] - 1})", param="metadata.rollout")
    return step, group, rollout


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
