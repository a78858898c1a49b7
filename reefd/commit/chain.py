"""The append-only release chain: a bare git repo (pygit2) with Git LFS objects and a CAS head per line, and
`plan`, a candidate checked against its pin and head; written only by `commit` (policy.py). Knows git and
release.json; nothing about HTTP, engines, gates or training. Blocking: callers on an event loop run it in a thread.

Each scenario has a shared line, and with per-user learning one line per user (`user=`). A user's line forks from
the shared line: its first release's parent is the shared head it was made on, so its history runs on into the
shared releases below, and every guarantee (append-only, CAS head, rollback, promote, rejected candidates) holds on
it as on the shared line. Dropping a user's line (erase.py) is the one write that removes history."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pygit2

from reefd.commit.chain_types import (
    BaseMismatch,
    HeadConflict,
    InvalidName,
    NoRelease,
    NothingToRollBack,
    Pinned,
    Release,
    ReleaseError,
    TrialRefused,
    UnknownRelease,
    WrongScenario,
    head_ref,
    line_label,
    line_root,
    rejected_prefix,
    validate_name,
)
from reefd.commit.trees import GITATTRIBUTES, METADATA, Trees

__all__ = ["ARTIFACT_FOLDER", "BaseMismatch", "Candidate", "HeadConflict", "InvalidName", "NoRelease",
           "NothingToRollBack", "Pinned", "Plan", "Release", "ReleaseChain", "ReleaseError", "TrialRefused",
           "UnknownRelease", "WrongScenario", "clear_stale_locks", "head_ref", "line_root", "plan", "rejected_prefix",
           "rollback_target", "trained_on", "validate_name"]

ARTIFACT_FOLDER = {"base": "weights", "adapter": "adapter", "weights": "weights", "harness": "harness",
                   "bundle": None}
BUNDLE_FOLDERS = ("adapter", "harness")  # what a bundle's artifact folder holds, each as a folder of its own
COPIES = ("rollback", "promote")
FAULT_ENV = "REEF_RELEASE_FAULT"  # after_lfs | after_commit | before_ref: os._exit(137) there (crash tests)
_ID_RE = re.compile(r"r(0|[1-9][0-9]{0,8})-([0-9a-f]{7})")
_SIG = pygit2.Signature("reefd", "reefd@localhost")

pygit2.option(pygit2.enums.Option.ENABLE_FSYNC_GITDIR, True)  # loose objects and refs reach disk before we move on


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os._exit(137)


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """One thread at a time in the repository: libgit2 objects are not to be shared between threads, and reefd
    calls the chain from a thread pool."""

    @functools.wraps(method)
    def wrapper(self: ReleaseChain, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class ReleaseChain:
    """Releases of every scenario in one bare repo at `path` (created if missing); `user=`: a user's line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if (self.path / "HEAD").exists():
            self.repo = pygit2.Repository(str(self.path))
        else:
            self.repo = pygit2.init_repository(str(self.path), bare=True)
        self.trees = Trees(self.repo, self.path)
        self.lock = threading.RLock()  # one thread at a time in the repository (erase.py takes it too)

    # ---- reading -------------------------------------------------------------------------------------------------
    @_locked
    def head(self, scenario: str, user: str | None = None) -> Release | None:
        """The head of the scenario's shared line, or of `user`'s line (None: that line has no release yet)."""
        ref = self.repo.references.get(head_ref(scenario, user))
        return None if ref is None else self._release(self.repo[ref.target].peel(pygit2.Commit))

    @_locked
    def line_head(self, scenario: str, user: str | None = None) -> Release | None:
        """What a new release on a line is made on: its head; for a user with no release of their own yet, the
        shared head (their line forks from it). A line's `expected_head` is this."""
        return self.head(scenario, user) or (self.head(scenario) if user is not None else None)

    @_locked
    def users(self, scenario: str) -> list[str]:
        """The users of `scenario` that have a line of their own."""
        prefix = line_root(scenario) + "users/"
        return sorted(n[len(prefix):].removesuffix("/head") for n in self.repo.references
                      if n.startswith(prefix) and n.endswith("/head"))

    @_locked
    def history(self, scenario: str, *, include_rejected: bool = False, user: str | None = None) -> list[Release]:
        """Releases of `scenario`'s shared line (or of `user`'s, then the shared ones it forked from), newest
        first; with `include_rejected`, the line's refused candidates too."""
        out = []
        rel = self.head(scenario, user)
        while rel is not None:
            out.append(rel)
            commit = self.repo[rel.commit].peel(pygit2.Commit)
            rel = self._release(commit.parents[0]) if commit.parents else None
        if include_rejected:
            out.extend(self.rejected(scenario, user))
            out.sort(key=lambda r: (r.seq, r.created_at, r.status == "released"), reverse=True)
        return out

    @_locked
    def rejected(self, scenario: str, user: str | None = None) -> list[Release]:
        """The candidates of a line that were refused (by a gate or a moved head), oldest first."""
        prefix = rejected_prefix(scenario, user)
        out = [dataclasses.replace(self._release(self.repo.references[name].peel(pygit2.Commit)), status="rejected")
               for name in self.repo.references if name.startswith(prefix)]
        return sorted(out, key=lambda r: (r.seq, r.created_at))

    @_locked
    def get(self, release_id: str, *, include_rejected: bool = False) -> Release:
        """A release reachable from its scenario's head (or, with `include_rejected`, a refused candidate)."""
        m = _ID_RE.fullmatch(release_id) if isinstance(release_id, str) else None
        if m is None:
            raise UnknownRelease(release_id)
        try:
            commit = self.repo.revparse_single(m.group(2)).peel(pygit2.Commit)
            rel = self._release(commit)
        except (KeyError, ValueError, pygit2.GitError) as e:  # missing, ambiguous, or not a release commit
            raise UnknownRelease(release_id) from e
        if rel.id != release_id:
            raise UnknownRelease(release_id)
        head = self.head(rel.scenario, rel.user)
        if head is not None and (head.commit == rel.commit or self.repo.descendant_of(head.commit, rel.commit)):
            return rel
        if include_rejected and self.repo.references.get(rejected_prefix(rel.scenario, rel.user) + rel.id) \
                is not None:
            return dataclasses.replace(rel, status="rejected")
        raise UnknownRelease(release_id)  # an unreachable commit (a lost race) is not a release

    @_locked
    def weights(self, release_id: str) -> dict[str, str | None]:
        """The weights a release serves: `tree` (the id of its `weights/` folder; None: the base model's own) and
        `release` (the release those weights came from: the one that published them, or the scenario's base)."""
        rel = self.get(release_id, include_rejected=True)
        tree = self.artifacts(rel.id).get("weights")
        origin = rel
        while origin.parent is not None:
            parent = self.get(origin.parent)
            if self.artifacts(parent.id).get("weights") != tree:
                break
            origin = parent
        return {"tree": tree, "release": origin.id}

    @_locked
    def artifacts(self, release_id: str) -> dict[str, str]:
        """The artifact folders of a release (`adapter`, `weights`, `harness`) and their tree ids: two releases
        serve the same thing exactly when these are equal."""
        tree = self.repo[self.get(release_id, include_rejected=True).commit].peel(pygit2.Commit).tree
        return {str(e.name): str(e.id) for e in tree if e.type_str == "tree"}

    def _release(self, commit: pygit2.Commit) -> Release:
        data = json.loads(self._blob(commit.tree, "release.json"))
        return Release(id=f"r{data['seq']}-{str(commit.id)[:7]}", scenario=data["scenario"], parent=data["parent"],
                       kind=data["kind"], meta=data["meta"], commit=str(commit.id), created_at=data["created_at"],
                       seq=data["seq"], user=data.get("user"))

    def _blob(self, tree: pygit2.Tree, name: str) -> bytes:
        return self.repo[tree[name].id].peel(pygit2.Blob).data

    # ---- writing -------------------------------------------------------------------------------------------------
    @_locked
    def publish(self, scenario: str, *, expected_head: str | None, kind: str, artifact_dir: Path | None,
                meta: dict[str, Any], folder: str | None = None, user: str | None = None) -> Release:
        """Append a release; the head moves only if it still is `expected_head` (a release id, None = no head yet).
        `artifact_dir` goes into the tree as the kind's folder (or `folder`: a base release may carry `harness`).
        With `user`, on that user's line: its first release is made on the shared head (NoRelease without one)."""
        if kind not in ARTIFACT_FOLDER or (user is not None and kind in ("base", "weights")):
            raise ValueError(f"kind must be one of {sorted(ARTIFACT_FOLDER)} (on a user's line: adapter, harness or "
                             "bundle); rollback/promote have their own calls")
        parent = self._expect(scenario, expected_head, user)
        if parent is None and user is not None:
            raise NoRelease(scenario)  # a user's line forks from the shared line
        entries = self._bring(scenario, parent, kind, artifact_dir, meta, folder)
        return self._append(scenario, parent, kind, entries, meta, user)

    def _bring(self, scenario: str, parent: Release | None, kind: str, artifact_dir: Path | None,
               meta: dict[str, Any], folder: str | None = None, check: bool = True
               ) -> dict[str, tuple[pygit2.Oid, int]]:
        """The tree of a new release of `kind` on `parent`: the parent's, with the artifact's folder(s) replaced (a
        bundle's artifact holds an adapter/ and a harness/ folder, both replaced together). `check`: an adapter
        must name the weights it was trained on (BaseMismatch)."""
        entries = self._entries(parent)
        if kind == "weights":  # an adapter trained on the old weights does not apply to the new ones
            entries.pop("adapter", None)
        elif kind in ("adapter", "bundle") and parent is not None and check:
            claim = trained_on(meta)
            have = str(entries["weights"][0]) if "weights" in entries else None
            if claim is not None and claim.get("tree") != have:
                raise BaseMismatch(scenario, claim.get("release") if claim.get("tree") else None,
                                   self.weights(parent.id)["release"] if have else None)
        if artifact_dir is None:
            return entries
        if kind == "bundle":
            present = [name for name in BUNDLE_FOLDERS if (Path(artifact_dir) / name).is_dir()]
            if present != list(BUNDLE_FOLDERS):
                raise ValueError(f"a bundle holds {' and '.join(f'{n}/' for n in BUNDLE_FOLDERS)}; "
                                 f"{artifact_dir} has {', '.join(present) or 'neither'}")
            for name in BUNDLE_FOLDERS:
                entries[name] = (self.trees.store(Path(artifact_dir) / name), pygit2.enums.FileMode.TREE)
        else:
            entries[folder or str(ARTIFACT_FOLDER[kind])] = (self.trees.store(Path(artifact_dir)),
                                                             pygit2.enums.FileMode.TREE)
        return entries

    @_locked
    def rollback(self, scenario: str, to: str | None = None, *, expected_head: str | None,
                 meta: dict[str, Any] | None = None, user: str | None = None) -> Release:
        """Append a release carrying `to`'s tree (default: the head's parent) on the line."""
        head = self._expect(scenario, expected_head, user)
        if head is None:
            raise UnknownRelease(f"{line_label(scenario, user)} has no releases")
        return self._copy(scenario, head, to or rollback_target(head), "rollback", meta, user)

    @_locked
    def promote(self, scenario: str, release_id: str, *, expected_head: str | None,
                meta: dict[str, Any] | None = None, user: str | None = None) -> Release:
        """Append a release carrying `release_id`'s tree (an older release, or a refused candidate) on the line."""
        return self._copy(scenario, self._expect(scenario, expected_head, user), release_id, "promote", meta, user)

    @_locked
    def target(self, scenario: str, release_id: str, *, include_rejected: bool = False,
               user: str | None = None) -> Release:
        """`release_id`, checked to belong to `scenario` and to be one a line may carry: the shared line's own
        releases, and on a user's line those and the user's (UnknownRelease, WrongScenario)."""
        target = self.get(release_id, include_rejected=include_rejected)
        if target.scenario != scenario:
            raise WrongScenario(f"{release_id} is a release of scenario {target.scenario!r}, not {scenario!r}")
        if target.user is not None and target.user != user:
            raise WrongScenario(f"{release_id} is a release of {line_label(scenario, target.user)}, not of "
                                f"{line_label(scenario, user)}")
        return target

    def _copy(self, scenario: str, head: Release | None, target_id: str, kind: str,
              meta: dict[str, Any] | None = None, user: str | None = None) -> Release:
        target = self.target(scenario, target_id, include_rejected=kind == "promote", user=user)
        entries = self._entries(target)
        doc = {"source": kind, **(meta or {}), "target": target.id, "target_meta": target.meta}
        return self._append(scenario, head, kind, entries, doc, user)

    @_locked
    def reject(self, scenario: str, *, built_on: str | None, kind: str, artifact_dir: Path | None,
               meta: dict[str, Any], user: str | None = None) -> Release:
        """Keep a refused candidate for the record (`history --all`): a commit on top of the head it was built on,
        under refs/reef/scenarios/<scenario>/rejected/<id> (a user's: …/users/<user>/rejected/<id>). The head does
        not move."""
        if kind not in ARTIFACT_FOLDER:
            raise ValueError(f"kind must be one of {sorted(ARTIFACT_FOLDER)}")
        parent = self.get(built_on) if built_on is not None else None
        # as publish would have made it, kept for the record even on weights it was not trained on
        entries = self._bring(scenario, parent, kind, artifact_dir, meta, check=False)
        oid = self._commit(scenario, parent, kind, entries, meta, user)
        rel = dataclasses.replace(self._release(self.repo[oid].peel(pygit2.Commit)), status="rejected")
        self.repo.references.create(rejected_prefix(scenario, user) + rel.id, oid, force=False)
        return rel

    def _expect(self, scenario: str, expected_head: str | None, user: str | None = None) -> Release | None:
        head = self.line_head(scenario, user)
        actual = head.id if head else None
        if actual != expected_head:
            raise HeadConflict(scenario, expected_head, actual, user)
        return head

    def _entries(self, rel: Release | None) -> dict[str, tuple[pygit2.Oid, int]]:
        if rel is None:
            return {}
        tree = self.repo[rel.commit].peel(pygit2.Commit).tree
        return {str(e.name): (e.id, e.filemode) for e in tree if e.name not in METADATA}

    def _append(self, scenario: str, parent: Release | None, kind: str, entries: dict[str, tuple[pygit2.Oid, int]],
                meta: dict[str, Any], user: str | None = None) -> Release:
        oid = self._commit(scenario, parent, kind, entries, meta, user)
        self._move_head(scenario, parent, oid, user)
        return self._release(self.repo[oid].peel(pygit2.Commit))

    def _commit(self, scenario: str, parent: Release | None, kind: str, entries: dict[str, tuple[pygit2.Oid, int]],
                meta: dict[str, Any], user: str | None = None) -> pygit2.Oid:
        seq = 0 if parent is None else parent.seq + 1
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        doc = {"scenario": scenario, "seq": seq, "parent": parent.id if parent else None, "kind": kind,
               "created_at": created_at, "meta": meta, **({"user": user} if user is not None else {})}
        body = json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
        _fault("after_lfs")
        tb = self.repo.TreeBuilder()
        tb.insert(".gitattributes", self.repo.create_blob(GITATTRIBUTES), pygit2.enums.FileMode.BLOB)
        tb.insert("release.json", self.repo.create_blob(body), pygit2.enums.FileMode.BLOB)
        for name, (oid, mode) in entries.items():
            tb.insert(name, oid, mode)
        parents = [pygit2.Oid(hex=parent.commit)] if parent else []
        msg = f"{kind} r{seq} of {scenario}" + ("" if user is None else f" (user {user})") + "\n"
        oid = self.repo.create_commit(None, _SIG, _SIG, msg, tb.write(), parents)
        _fault("after_commit")
        return oid

    def _move_head(self, scenario: str, parent: Release | None, oid: pygit2.Oid, user: str | None = None) -> None:
        """Move the line's head from `parent` to `oid` (compare-and-swap); a user's first release creates it."""
        name = head_ref(scenario, user)
        first = parent is None or (user is not None and parent.user is None)  # a line's first release
        expected = None if first or parent is None else parent.id
        _fault("before_ref")
        try:
            if first:
                self.repo.references.create(name, oid, force=False)
            else:
                assert parent is not None
                ref = self.repo.references[name]
                if str(ref.target) != parent.commit:
                    raise HeadConflict(scenario, parent.id, self._head_id(scenario, user), user)
                ref.set_target(oid, f"reef: append {scenario}")  # libgit2 CAS: locks the ref, checks the old value
        except (pygit2.GitError, OSError) as e:  # exists / old value does not match / ref.lock held by another writer
            if isinstance(e, OSError) and not isinstance(e, pygit2.GitError) and "lock" not in str(e):
                raise
            raise HeadConflict(scenario, expected, self._head_id(scenario, user), user) from e

    def _head_id(self, scenario: str, user: str | None = None) -> str | None:
        head = self.line_head(scenario, user)
        return head.id if head else None

    # ---- contents ------------------------------------------------------------------------------------------------
    def _tree(self, release_id: str, *, include_rejected: bool = True) -> pygit2.Tree:
        return self.repo[self.get(release_id, include_rejected=include_rejected).commit].peel(pygit2.Commit).tree

    def lfs_object(self, oid: str) -> Path:
        return self.trees.lfs_object(oid)

    @_locked
    def lfs_pointers(self, release_id: str) -> dict[str, tuple[str, int]]:
        """Path -> (sha256 oid, size) of every LFS pointer in a release's tree."""
        return {p: (oid, n) for p, _, oid, n in self.trees.walk(self._tree(release_id, include_rejected=False))
                if oid is not None}

    @_locked
    def materialize(self, release_id: str, dest: Path, folder: str | None = None) -> Path:
        """Write a release's files (LFS content restored and verified) into `dest`, which must be empty or missing;
        with `folder` (e.g. "adapter"), only that folder's contents."""
        tree = self._tree(release_id)
        if folder is not None:
            tree = self.repo[tree[folder].id].peel(pygit2.Tree)
        return self.trees.materialize(tree, Path(dest))

    @_locked
    def diff(self, a: str, b: str) -> dict[str, Any]:
        """Metadata and per-file differences from release `a` to release `b` (see Trees.diff)."""
        ra, rb = self.get(a, include_rejected=True), self.get(b, include_rejected=True)
        keys = set(ra.meta) | set(rb.meta)
        return {"kind": (ra.kind, rb.kind),
                "meta": {k: (ra.meta.get(k), rb.meta.get(k)) for k in sorted(keys) if ra.meta.get(k) != rb.meta.get(k)},
                **self.trees.diff(self._tree(a), self._tree(b))}

    @_locked
    def files(self, release_id: str) -> list[dict[str, Any]]:
        """Every file of a release: path, size, sha256 (the LFS oid for LFS files), lfs."""
        return self.trees.files(self._tree(release_id))



def clear_stale_locks(path: Path) -> list[Path]:
    """Remove head lock files a killed writer left behind in the repo at `path`. Only for the repo's sole writer
    (reefd at start), since a live writer's lock must never be removed."""
    refs = path / "refs" / "reef" / "scenarios"
    stale = [*refs.glob("*/head.lock"), *refs.glob("*/users/*/head.lock")] if refs.is_dir() else []
    for lock in stale:
        lock.unlink(missing_ok=True)
    return stale


def rollback_target(head: Release) -> str:
    """Where a plain rollback goes: the head's parent."""
    if head.parent is None:
        raise NothingToRollBack(f"{head.id} is the first release of {head.scenario!r}; there is nothing to roll "
                                "back to")
    return head.parent


def trained_on(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The weights an adapter release says it was trained on (`meta["weights"]`: tree and release), looked up
    through the copies (rollback, promote) that carry it; None when it does not say (an older release)."""
    while isinstance(meta, dict):
        claim = meta.get("weights")
        if isinstance(claim, dict):
            return claim
        meta = meta.get("target_meta")  # type: ignore[assignment]
    return None


# ---- candidates ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """What a caller asks the chain to append: an artifact folder (adapter, harness, weights; a base release may
    carry a harness), or a copy of another release's tree (rollback, promote)."""

    kind: str
    meta: dict[str, Any]  # release.json's meta: source, summary, metrics, the receipts it learned from, ...
    artifact: Path | None = None  # the folder stored as the kind's artifact
    folder: str | None = None  # store `artifact` under this folder name instead of the kind's
    target: str | None = None  # rollback and promote: the release whose tree is carried (rollback: None = parent)
    built_on: str | None = None  # the head the candidate was made on; None: the head when it is committed
    exact: bool = False  # built_on was named by the caller (an expected head): a moved head refuses it
    verdict: dict[str, Any] | None = None  # the gate's verdict (meta["gate"]); a failing one is never released
    applies_pin: bool = False  # the reconciler's rollback to release.pin: the one copy a pinned scenario takes
    user: str | None = None  # the user whose line it goes on (None: the scenario's shared line)


@dataclass(frozen=True)
class Plan:
    """What a commit would do now: append on `head` (None: the scenario's first release; on a user's line with no
    release yet, the shared head it forks from), carrying `target`'s tree for a copy."""

    head: Release | None
    target: Release | None


def plan(chain: ReleaseChain, scenario: str, cand: Candidate, *, pin: str | None) -> Plan:
    """Check a candidate against the scenario's pin and head without writing anything (a dry run, or a refusal
    before an upload), in this order. Pinned: a pinned scenario takes only its base release and the
    reconciler's copy of the pinned one; NoRelease: only a base may be a scenario's first release; HeadConflict:
    an exact candidate whose head moved; UnknownRelease, WrongScenario, NothingToRollBack: a copy's target."""
    if pin is not None and cand.user is None and cand.kind != "base" and \
            not (cand.applies_pin and cand.target == pin):
        raise Pinned(scenario, pin)  # the pin is the shared line's
    head = chain.line_head(scenario, cand.user)
    if head is None and cand.kind != "base":
        raise NoRelease(scenario)
    if cand.exact and (head.id if head else None) != cand.built_on:
        raise HeadConflict(scenario, cand.built_on, head.id if head else None, cand.user)
    target = None
    if cand.kind in COPIES and head is not None:
        target = chain.target(scenario, cand.target or rollback_target(head),
                              include_rejected=cand.kind == "promote", user=cand.user)
    return Plan(head, target)
