"""Small durable-file helpers shared by the stores that keep JSON files under STATE (jobs, attempts, archives).

Knows files and fsync; nothing about what the documents mean.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """Make a file's data, or a folder's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, doc: Any, indent: int | None = None, *, private: bool = False) -> None:
    """Replace `path` with `doc` as JSON, atomically: written beside it, fsynced, renamed, the rename fsynced.
    `private`: readable by its owner only (0600), and written as root it belongs to the folder's owner, so that
    `sudo` on an operator's command leaves a file the daemon's own user can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    if private and os.geteuid() == 0:
        folder = path.parent.stat()
        os.fchown(fd, folder.st_uid, folder.st_gid)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:  # a full disk, say: no half-written file is left beside the old one
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
