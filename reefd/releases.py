"""The append-only release chain: a bare git repo (pygit2) with Git LFS objects and a CAS head per scenario.

Knows git, LFS pointers and release.json; knows nothing about HTTP, engines, gates or training.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pygit2

KINDS = ("base", "adapter", "weights", "harness", "rollback", "promote")
ARTIFACT_FOLDER = {"base": "weights", "adapter": "adapter", "weights": "weights", "harness": "harness"}
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
FAULT_ENV = "REEF_RELEASE_FAULT"  # after_lfs | after_commit | before_ref: os._exit(137) there (crash tests)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ID_RE = re.compile(r"r(0|[1-9][0-9]{0,8})-([0-9a-f]{7})")
_POINTER_RE = re.compile(rb"version https://git-lfs\.github\.com/spec/v1\noid sha256:([0-9a-f]{64})\nsize ([0-9]+)\n")
_SIG = pygit2.Signature("reefd", "reefd@localhost")
_CHUNK = 1 << 20

pygit2.option(pygit2.enums.Option.ENABLE_FSYNC_GITDIR, True)  # loose objects and refs reach disk before we move on


class ReleaseError(Exception):
    """Base class for release chain errors."""


class InvalidName(ReleaseError, ValueError):
    """A scenario name that could escape the ref namespace or the filesystem."""


class UnknownRelease(ReleaseError, KeyError):
    """No release with this id is reachable from its scenario's head."""


class WrongScenario(ReleaseError, ValueError):
    """The target release belongs to another scenario."""


class HeadConflict(ReleaseError):
    """The scenario head is not what the publisher expected; nothing was overwritten."""

    def __init__(self, scenario: str, expected: str | None, actual: str | None) -> None:
        super().__init__(f"scenario {scenario!r}: expected head {expected}, found {actual}")
        self.scenario, self.expected, self.actual = scenario, expected, actual


@dataclass(frozen=True)
class Release:
    id: str
    scenario: str
    parent: str | None
    kind: str
    meta: dict[str, Any]
    commit: str
    created_at: str
    seq: int
    status: str = "released"  # or "rejected": a candidate the gates refused, kept for the record, never served


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name or name.endswith((".lock", ".")):
        raise InvalidName(f"invalid scenario name: {name!r}")
    return name


def head_ref(scenario: str) -> str:
    return f"refs/reef/scenarios/{validate_name(scenario)}/head"


def rejected_prefix(scenario: str) -> str:
    return f"refs/reef/scenarios/{validate_name(scenario)}/rejected/"


def is_lfs_path(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os._exit(137)


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """One thread at a time in the repository: libgit2 objects are not to be shared between threads, and reefd
    calls the chain from a thread pool."""

    @functools.wraps(method)
    def wrapper(self: ReleaseChain, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReleaseChain:
    """Releases of every scenario in one bare repo at `path` (created if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if (self.path / "HEAD").exists():
            self.repo = pygit2.Repository(str(self.path))
        else:
            self.repo = pygit2.init_repository(str(self.path), bare=True)
        self.lfs_dir = self.path / "lfs" / "objects"
        self._lock = threading.RLock()
        (self.path / "lfs" / "tmp").mkdir(parents=True, exist_ok=True)

    # ---- reading -------------------------------------------------------------------------------------------------
    @_locked
    def head(self, scenario: str) -> Release | None:
        ref = self.repo.references.get(head_ref(scenario))
        return None if ref is None else self._release(self.repo[ref.target].peel(pygit2.Commit))

    @_locked
    def history(self, scenario: str, *, include_rejected: bool = False) -> list[Release]:
        """Releases of `scenario`, newest first; with `include_rejected`, the refused candidates too."""
        out = []
        rel = self.head(scenario)
        while rel is not None:
            out.append(rel)
            commit = self.repo[rel.commit].peel(pygit2.Commit)
            rel = self._release(commit.parents[0]) if commit.parents else None
        if include_rejected:
            out.extend(self.rejected(scenario))
            out.sort(key=lambda r: (r.seq, r.created_at, r.status == "released"), reverse=True)
        return out

    @_locked
    def rejected(self, scenario: str) -> list[Release]:
        """The candidates of `scenario` that were refused (by a gate or a moved head), oldest first."""
        prefix = rejected_prefix(scenario)
        out = []
        for name in self.repo.references:
            if name.startswith(prefix):
                commit = self.repo.references[name].peel(pygit2.Commit)
                out.append(dataclasses.replace(self._release(commit), status="rejected"))
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
        head = self.head(rel.scenario)
        if head is not None and (head.commit == rel.commit or self.repo.descendant_of(head.commit, rel.commit)):
            return rel
        if include_rejected and self.repo.references.get(rejected_prefix(rel.scenario) + rel.id) is not None:
            return dataclasses.replace(rel, status="rejected")
        raise UnknownRelease(release_id)  # an unreachable commit (a lost race) is not a release

    @_locked
    def artifacts(self, release_id: str) -> dict[str, str]:
        """The artifact folders of a release (`adapter`, `weights`, `harness`) and their tree ids: two releases
        serve the same thing exactly when these are equal."""
        tree = self.repo[self.get(release_id, include_rejected=True).commit].peel(pygit2.Commit).tree
        return {str(e.name): str(e.id) for e in tree if e.type_str == "tree"}

    def _release(self, commit: pygit2.Commit) -> Release:
        data = json.loads(self._blob(commit.tree, "release.json"))
        return Release(
            id=f"r{data['seq']}-{str(commit.id)[:7]}",
            scenario=data["scenario"],
            parent=data["parent"],
            kind=data["kind"],
            meta=data["meta"],
            commit=str(commit.id),
            created_at=data["created_at"],
            seq=data["seq"],
        )

    def _blob(self, tree: pygit2.Tree, name: str) -> bytes:
        return self.repo[tree[name].id].peel(pygit2.Blob).data

    # ---- writing -------------------------------------------------------------------------------------------------
    @_locked
    def publish(
        self,
        scenario: str,
        *,
        expected_head: str | None,
        kind: str,
        artifact_dir: Path | None,
        meta: dict[str, Any],
        folder: str | None = None,
    ) -> Release:
        """Append a release; the head moves only if it still is `expected_head` (a release id, None = no head yet).
        `artifact_dir` goes into the tree as the kind's folder (or `folder`: a base release may carry `harness`)."""
        if kind not in ARTIFACT_FOLDER:
            raise ValueError(f"kind must be one of {sorted(ARTIFACT_FOLDER)}; rollback/promote have their own calls")
        parent = self._expect(scenario, expected_head)
        entries = self._entries(parent)
        if artifact_dir is not None:
            name = folder or ARTIFACT_FOLDER[kind]
            entries[name] = (self._store_dir(Path(artifact_dir)), pygit2.enums.FileMode.TREE)
        return self._append(scenario, parent, kind, entries, meta)

    @_locked
    def rollback(self, scenario: str, to: str | None = None, *, expected_head: str | None,
                 meta: dict[str, Any] | None = None) -> Release:
        """Append a release carrying `to`'s tree (default: the head's parent)."""
        head = self._expect(scenario, expected_head)
        if head is None:
            raise UnknownRelease(f"scenario {scenario!r} has no releases")
        return self._copy(scenario, head, to or self.rollback_target(head), "rollback", meta)

    @staticmethod
    def rollback_target(head: Release) -> str:
        """Where a plain rollback goes: the head's parent."""
        if head.parent is None:
            raise UnknownRelease(f"{head.id} is the scenario's first release; there is nothing to roll back to")
        return head.parent

    @_locked
    def promote(self, scenario: str, release_id: str, *, expected_head: str | None,
                meta: dict[str, Any] | None = None) -> Release:
        """Append a release carrying `release_id`'s tree (an older release, or a refused candidate)."""
        return self._copy(scenario, self._expect(scenario, expected_head), release_id, "promote", meta)

    @_locked
    def target(self, scenario: str, release_id: str, *, include_rejected: bool = False) -> Release:
        """`release_id`, checked to belong to `scenario` (UnknownRelease, WrongScenario)."""
        target = self.get(release_id, include_rejected=include_rejected)
        if target.scenario != scenario:
            raise WrongScenario(f"{release_id} is a release of scenario {target.scenario!r}, not {scenario!r}")
        return target

    def _copy(self, scenario: str, head: Release | None, target_id: str, kind: str,
              meta: dict[str, Any] | None = None) -> Release:
        target = self.target(scenario, target_id, include_rejected=kind == "promote")
        entries = self._entries(target)
        doc = {"source": kind, **(meta or {}), "target": target.id, "target_meta": target.meta}
        return self._append(scenario, head, kind, entries, doc)

    @_locked
    def reject(self, scenario: str, *, built_on: str | None, kind: str, artifact_dir: Path | None,
               meta: dict[str, Any]) -> Release:
        """Keep a refused candidate for the record (`history --all`): a commit on top of the head it was built on,
        under refs/reef/scenarios/<scenario>/rejected/<id>. The head does not move."""
        if kind not in ARTIFACT_FOLDER:
            raise ValueError(f"kind must be one of {sorted(ARTIFACT_FOLDER)}")
        parent = self.get(built_on) if built_on is not None else None
        entries = self._entries(parent)
        if artifact_dir is not None:
            entries[ARTIFACT_FOLDER[kind]] = (self._store_dir(Path(artifact_dir)), pygit2.enums.FileMode.TREE)
        oid = self._commit(scenario, parent, kind, entries, meta)
        rel = dataclasses.replace(self._release(self.repo[oid].peel(pygit2.Commit)), status="rejected")
        self.repo.references.create(rejected_prefix(scenario) + rel.id, oid, force=False)
        return rel

    def _expect(self, scenario: str, expected_head: str | None) -> Release | None:
        head = self.head(scenario)
        actual = head.id if head else None
        if actual != expected_head:
            raise HeadConflict(scenario, expected_head, actual)
        return head

    def _entries(self, rel: Release | None) -> dict[str, tuple[pygit2.Oid, int]]:
        if rel is None:
            return {}
        tree = self.repo[rel.commit].peel(pygit2.Commit).tree
        return {str(e.name): (e.id, e.filemode) for e in tree if e.name not in ("release.json", ".gitattributes")}

    def _append(
        self,
        scenario: str,
        parent: Release | None,
        kind: str,
        entries: dict[str, tuple[pygit2.Oid, int]],
        meta: dict[str, Any],
    ) -> Release:
        oid = self._commit(scenario, parent, kind, entries, meta)
        self._move_head(scenario, parent, oid)
        return self._release(self.repo[oid].peel(pygit2.Commit))

    def _commit(
        self,
        scenario: str,
        parent: Release | None,
        kind: str,
        entries: dict[str, tuple[pygit2.Oid, int]],
        meta: dict[str, Any],
    ) -> pygit2.Oid:
        seq = 0 if parent is None else parent.seq + 1
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        doc = {"scenario": scenario, "seq": seq, "parent": parent.id if parent else None, "kind": kind,
               "created_at": created_at, "meta": meta}
        body = json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
        _fault("after_lfs")
        tb = self.repo.TreeBuilder()
        tb.insert(".gitattributes", self.repo.create_blob(GITATTRIBUTES), pygit2.enums.FileMode.BLOB)
        tb.insert("release.json", self.repo.create_blob(body), pygit2.enums.FileMode.BLOB)
        for name, (oid, mode) in entries.items():
            tb.insert(name, oid, mode)
        parents = [pygit2.Oid(hex=parent.commit)] if parent else []
        msg = f"{kind} r{seq} of {scenario}\n"
        oid = self.repo.create_commit(None, _SIG, _SIG, msg, tb.write(), parents)
        _fault("after_commit")
        return oid

    def _move_head(self, scenario: str, parent: Release | None, oid: pygit2.Oid) -> None:
        name = head_ref(scenario)
        _fault("before_ref")
        try:
            if parent is None:
                self.repo.references.create(name, oid, force=False)
            else:
                ref = self.repo.references[name]
                if str(ref.target) != parent.commit:
                    raise HeadConflict(scenario, parent.id, self._head_id(scenario))
                ref.set_target(oid, f"reef: append {scenario}")  # libgit2 CAS: locks the ref, checks the old value
        except (pygit2.GitError, OSError) as e:  # exists / old value does not match / ref.lock held by another writer
            if isinstance(e, OSError) and not isinstance(e, pygit2.GitError) and "lock" not in str(e):
                raise
            raise HeadConflict(scenario, parent.id if parent else None, self._head_id(scenario)) from e

    def _head_id(self, scenario: str) -> str | None:
        head = self.head(scenario)
        return head.id if head else None

    # ---- artifacts and LFS ---------------------------------------------------------------------------------------
    def _store_dir(self, src: Path) -> pygit2.Oid:
        """Write `src` as a tree; LFS-pattern files go to lfs/objects (fsynced) and become pointer blobs."""
        tb = self.repo.TreeBuilder()
        for child in sorted(src.iterdir()):
            if child.is_symlink():
                raise ValueError(f"symlinks are not allowed in artifacts: {child}")
            if child.is_dir():
                tb.insert(child.name, self._store_dir(child), pygit2.enums.FileMode.TREE)
            elif child.is_file():
                if is_lfs_path(child.name):
                    oid, size = self._store_lfs(child)
                    blob = self.repo.create_blob(LFS_POINTER.format(oid=oid, size=size).encode())
                else:
                    blob = self.repo.create_blob(child.read_bytes())
                tb.insert(child.name, blob, pygit2.enums.FileMode.BLOB)
        return tb.write()

    def lfs_object(self, oid: str) -> Path:
        return self.lfs_dir / oid[0:2] / oid[2:4] / oid

    def _store_lfs(self, src: Path) -> tuple[str, int]:
        h, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=self.path / "lfs" / "tmp")
        try:
            with os.fdopen(fd, "wb") as out, src.open("rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            dest = self.lfs_object(h.hexdigest())
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
            _fsync_dir(dest.parent)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return h.hexdigest(), size

    @_locked
    def lfs_pointers(self, release_id: str) -> dict[str, tuple[str, int]]:
        """Path -> (sha256 oid, size) of every LFS pointer in a release's tree."""
        tree = self.repo[self.get(release_id).commit].peel(pygit2.Commit).tree
        return {p: (oid, n) for p, _, oid, n in self._walk(tree) if oid is not None}

    def _walk(self, tree: pygit2.Tree, prefix: str = "") -> Iterator[tuple[str, bytes, str | None, int]]:
        """Yield (path, blob data, lfs oid or None, lfs size) for every file."""
        for e in tree:
            name, obj = str(e.name), self.repo[e.id]
            if isinstance(obj, pygit2.Tree):
                yield from self._walk(obj, f"{prefix}{name}/")
            else:
                data = obj.peel(pygit2.Blob).data
                m = _POINTER_RE.fullmatch(data) if is_lfs_path(name) else None
                yield (f"{prefix}{name}", data, m.group(1).decode() if m else None, int(m.group(2)) if m else 0)

    @_locked
    def materialize(self, release_id: str, dest: Path, folder: str | None = None) -> Path:
        """Write a release's files (LFS content restored and verified) into `dest`, which must be empty or missing;
        with `folder` (e.g. "adapter"), only that folder's contents."""
        dest = Path(dest)
        if dest.exists() and any(dest.iterdir()):
            raise FileExistsError(f"{dest} is not empty")
        tree = self.repo[self.get(release_id, include_rejected=True).commit].peel(pygit2.Commit).tree
        if folder is not None:
            tree = self.repo[tree[folder].id].peel(pygit2.Tree)
        dest.mkdir(parents=True, exist_ok=True)
        for rel_path, data, oid, size in self._walk(tree):
            out = dest / rel_path
            out.parent.mkdir(parents=True, exist_ok=True)
            if oid is None:
                out.write_bytes(data)
                continue
            h = hashlib.sha256()
            with self.lfs_object(oid).open("rb") as f, out.open("wb") as w:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
                    w.write(chunk)
            if h.hexdigest() != oid or out.stat().st_size != size:
                raise ReleaseError(f"LFS object {oid} is corrupt ({rel_path})")
        return dest

    @_locked
    def diff(self, a: str, b: str) -> dict[str, Any]:
        """Metadata and per-file differences from release `a` to release `b` (files keyed by sha256 / LFS oid),
        with a unified diff for every changed text file (LFS files and binary files are compared by hash only)."""
        ra, rb = self.get(a, include_rejected=True), self.get(b, include_rejected=True)
        fa, fb = self._digests(ra), self._digests(rb)
        keys = set(ra.meta) | set(rb.meta)
        added, removed = sorted(set(fb) - set(fa)), sorted(set(fa) - set(fb))
        changed = sorted(p for p in set(fa) & set(fb) if fa[p] != fb[p])
        ta, tb = self._texts(ra), self._texts(rb)
        text = {}
        for path in sorted([*added, *removed, *changed]):
            if (path in ta or path not in fa) and (path in tb or path not in fb) and (path in ta or path in tb):
                lines = difflib.unified_diff(ta.get(path, "").splitlines(keepends=True),
                                             tb.get(path, "").splitlines(keepends=True),
                                             f"a/{path}" if path in fa else "/dev/null",
                                             f"b/{path}" if path in fb else "/dev/null")
                text[path] = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                                     for line in lines)
        return {
            "kind": (ra.kind, rb.kind),
            "meta": {k: (ra.meta.get(k), rb.meta.get(k)) for k in sorted(keys) if ra.meta.get(k) != rb.meta.get(k)},
            "added": added,
            "removed": removed,
            "changed": changed,
            "text": text,
        }

    def _texts(self, rel: Release, limit: int = 1 << 20) -> dict[str, str]:
        """Path -> content of the release's small UTF-8 text files (not LFS)."""
        tree = self.repo[rel.commit].peel(pygit2.Commit).tree
        out = {}
        for p, data, oid, _ in self._walk(tree):
            if oid is None and p not in ("release.json", ".gitattributes") and len(data) <= limit \
                    and b"\0" not in data:
                try:
                    out[p] = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
        return out

    @_locked
    def files(self, release_id: str) -> list[dict[str, Any]]:
        """Every file of a release: path, size, sha256 (the LFS oid for LFS files), lfs."""
        tree = self.repo[self.get(release_id, include_rejected=True).commit].peel(pygit2.Commit).tree
        return [{"path": p, "size": size if oid else len(data), "lfs": oid is not None,
                 "sha256": oid or hashlib.sha256(data).hexdigest()}
                for p, data, oid, size in self._walk(tree)]

    def clear_stale_locks(self) -> list[Path]:
        """Remove head lock files a killed writer left behind. Only for the repo's sole writer
        (reefd at start), since a live writer's lock must never be removed."""
        refs = self.path / "refs" / "reef" / "scenarios"
        stale = list(refs.glob("*/head.lock")) if refs.is_dir() else []
        for lock in stale:
            lock.unlink(missing_ok=True)
        return stale

    def _digests(self, rel: Release) -> dict[str, str]:
        tree = self.repo[rel.commit].peel(pygit2.Commit).tree
        return {p: oid or hashlib.sha256(data).hexdigest()
                for p, data, oid, _ in self._walk(tree) if p not in ("release.json", ".gitattributes")}
