"""A user's line out of the release chain: its refs dropped, then what nothing reaches removed, git objects
(reflogs expired, then `git gc --prune=now`) and LFS objects no remaining release points to. Blocking, under the
chain's lock. Knows git and the LFS layout; nothing about HTTP or engines."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pygit2

from reefd.commit.chain import ReleaseChain, line_root
from reefd.commit.trees import Trees

GIT_TIMEOUT_S = 600


class PruneFailed(RuntimeError):
    """`git` could not prune the repository; what it said is the message."""


def drop_line(chain: ReleaseChain, scenario: str, user: str) -> list[str]:
    """Delete `user`'s line, its head and its refused candidates: the one write that removes history (a user's
    deletion). Returns the ids of the releases and candidates that were theirs; `prune` then removes what
    nothing reaches any more."""
    with chain.lock:
        gone = [r.id for r in chain.history(scenario, include_rejected=True, user=user) if r.user == user]
        root = line_root(scenario, user)
        for name in [n for n in chain.repo.references if n.startswith(root)]:
            chain.repo.references.delete(name)
        return gone


def prune(chain: ReleaseChain) -> dict[str, int]:
    """Drop every git object and LFS object no ref reaches; returns how many LFS objects and bytes went."""
    with chain.lock:
        return _prune(chain.repo, chain.path, chain.trees)


def _prune(repo: pygit2.Repository, path: Path, trees: Trees) -> dict[str, int]:
    env = {**os.environ, "GIT_DIR": str(path), "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    for argv in (["git", "reflog", "expire", "--expire=now", "--all"],
                 ["git", "-c", "gc.auto=0", "gc", "--prune=now", "--quiet"]):
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PruneFailed(f"{' '.join(argv[:3])}: {exc}") from None
        if done.returncode != 0:
            raise PruneFailed(f"{' '.join(argv[:3])}: {done.stderr.strip() or done.returncode}")
    kept = reachable_lfs(repo, trees)
    gone = size = 0
    for obj in list(trees.lfs_dir.glob("*/*/*")) if trees.lfs_dir.is_dir() else []:
        if obj.is_file() and obj.name not in kept:
            size += obj.stat().st_size
            obj.unlink()
            gone += 1
    return {"lfs_objects": gone, "lfs_bytes": size}


def reachable_lfs(repo: pygit2.Repository, trees: Trees) -> set[str]:
    """The LFS oids some commit that a ref reaches points to."""
    seen: set[str] = set()
    kept: set[str] = set()
    for name in repo.references:
        target = repo.references[name].peel(pygit2.Commit).id
        for commit in repo.walk(target):
            if str(commit.id) in seen:
                continue
            seen.add(str(commit.id))
            kept.update(oid for _, _, oid, _ in trees.walk(commit.tree) if oid is not None)
    return kept
