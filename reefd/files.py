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


def write_json(path: Path, doc: Any, indent: int | None = None) -> None:
    """Replace `path` with `doc` as JSON, atomically: written beside it, fsynced, renamed, the rename fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(doc, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_path(path.parent)
