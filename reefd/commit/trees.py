"""Release contents in git: an artifact folder stored as a tree, its large files as Git LFS objects (under the
repo's lfs/objects, fsynced) behind pointer blobs; trees walked, written back out verified, listed and diffed.

Knows git trees, blobs and the LFS pointer format; nothing about releases, scenarios or heads.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pygit2

from reefd.ops.files import fsync_path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
METADATA = ("release.json", ".gitattributes")  # a release's own files, beside its artifacts
_POINTER_RE = re.compile(rb"version https://git-lfs\.github\.com/spec/v1\noid sha256:([0-9a-f]{64})\nsize ([0-9]+)\n")
_CHUNK = 1 << 20


class CorruptObject(OSError):
    """An LFS object whose bytes do not match its pointer."""


def is_lfs_path(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


File = tuple[str, bytes, str | None, int]  # (path, blob data, LFS oid or None, LFS size)



def tree_id(files: dict[str, bytes]) -> str:
    """The git tree id of these files (paths relative to the tree, no LFS), computed without a repository: what
    `Trees.store` of them writes."""
    entries: dict[str, bytes | dict[str, bytes]] = {}
    for path, data in files.items():
        head, _, rest = path.partition("/")
        if rest:
            sub = entries.setdefault(head, {})
            assert isinstance(sub, dict)
            sub[rest] = data
        else:
            entries[head] = data
    body = b""
    for name in sorted(entries, key=lambda n: n + "/" if isinstance(entries[n], dict) else n):  # git's order
        value = entries[name]
        if isinstance(value, dict):
            body += b"40000 " + name.encode() + b"\0" + bytes.fromhex(tree_id(value))
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(value) + value).hexdigest()
            body += b"100644 " + name.encode() + b"\0" + bytes.fromhex(blob)
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()

class Trees:
    """Trees of one bare repo at `path`; LFS objects in path/lfs/objects, temporary files in path/lfs/tmp.
    Not thread-safe: the caller serialises (ReleaseChain holds its lock around every call)."""

    def __init__(self, repo: pygit2.Repository, path: Path) -> None:
        self.repo = repo
        self.lfs_dir = path / "lfs" / "objects"
        self.tmp_dir = path / "lfs" / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    def store(self, src: Path) -> pygit2.Oid:
        """Write the folder `src` as a tree; LFS-pattern files go to lfs/objects (fsynced) and become pointers."""
        tb = self.repo.TreeBuilder()
        for child in sorted(src.iterdir()):
            if child.is_symlink():
                raise ValueError(f"symlinks are not allowed in artifacts: {child}")
            if child.is_dir():
                tb.insert(child.name, self.store(child), pygit2.enums.FileMode.TREE)
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
        fd, tmp = tempfile.mkstemp(dir=self.tmp_dir)
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
            fsync_path(dest.parent)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return h.hexdigest(), size

    def walk(self, tree: pygit2.Tree, prefix: str = "") -> Iterator[File]:
        """Every file of `tree`, depth first."""
        for e in tree:
            name, obj = str(e.name), self.repo[e.id]
            if isinstance(obj, pygit2.Tree):
                yield from self.walk(obj, f"{prefix}{name}/")
            else:
                data = obj.peel(pygit2.Blob).data
                m = _POINTER_RE.fullmatch(data) if is_lfs_path(name) else None
                yield (f"{prefix}{name}", data, m.group(1).decode() if m else None, int(m.group(2)) if m else 0)

    def materialize(self, tree: pygit2.Tree, dest: Path) -> Path:
        """Write `tree`'s files (LFS content restored and checked against its sha256) into `dest`, which must be
        empty or missing; CorruptObject when an object does not match its pointer."""
        if dest.exists() and any(dest.iterdir()):
            raise FileExistsError(f"{dest} is not empty")
        dest.mkdir(parents=True, exist_ok=True)
        for rel_path, data, oid, size in self.walk(tree):
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
                raise CorruptObject(f"LFS object {oid} is corrupt ({rel_path})")
        return dest

    def files(self, tree: pygit2.Tree) -> list[dict[str, Any]]:
        """Every file: path, size, sha256 (the LFS oid for LFS files), lfs."""
        return [{"path": p, "size": size if oid else len(data), "lfs": oid is not None,
                 "sha256": oid or hashlib.sha256(data).hexdigest()} for p, data, oid, size in self.walk(tree)]

    def diff(self, a: pygit2.Tree, b: pygit2.Tree) -> dict[str, list[str] | dict[str, str]]:
        """Added, removed and changed files from `a` to `b` (by sha256 / LFS oid, the release's own files left
        out), with a unified diff for every small UTF-8 text file among them (LFS files by hash only)."""
        fa, fb = self._digests(a), self._digests(b)
        added, removed = sorted(set(fb) - set(fa)), sorted(set(fa) - set(fb))
        changed = sorted(p for p in set(fa) & set(fb) if fa[p] != fb[p])
        ta, tb = self._texts(a), self._texts(b)
        text = {}
        for path in sorted([*added, *removed, *changed]):
            if (path in ta or path not in fa) and (path in tb or path not in fb) and (path in ta or path in tb):
                lines = difflib.unified_diff(ta.get(path, "").splitlines(keepends=True),
                                             tb.get(path, "").splitlines(keepends=True),
                                             f"a/{path}" if path in fa else "/dev/null",
                                             f"b/{path}" if path in fb else "/dev/null")
                text[path] = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                                     for line in lines)
        return {"added": added, "removed": removed, "changed": changed, "text": text}

    def _digests(self, tree: pygit2.Tree) -> dict[str, str]:
        return {p: oid or hashlib.sha256(data).hexdigest() for p, data, oid, _ in self.walk(tree) if p not in METADATA}

    def _texts(self, tree: pygit2.Tree, limit: int = 1 << 20) -> dict[str, str]:
        """Path -> content of the tree's small UTF-8 text files (not LFS)."""
        out = {}
        for p, data, oid, _ in self.walk(tree):
            if oid is None and p not in METADATA and len(data) <= limit and b"\0" not in data:
                with contextlib.suppress(UnicodeDecodeError):
                    out[p] = data.decode("utf-8")
        return out
