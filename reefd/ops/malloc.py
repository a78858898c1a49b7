"""The daemon's memory after big requests: buffers go back to the system when freed.

glibc serves a big allocation with its own mapping, returned on free, until a freed one raises that threshold (up
to 32 MiB): after one large request body, later ones stay in the heap for good (reefd kept 170 MB after two 10 MiB
prompts). `return_big_buffers` fixes the threshold at start; `trim` hands back what a big request left free in the
heap. Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

BIG_BODY = 1 << 20  # a request body past this is followed by a trim
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _glibc() -> Any:
    if sys.platform != "linux" or (name := ctypes.util.find_library("c")) is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc only: musl has neither)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def return_big_buffers() -> None:
    """Buffers of 256 KiB and more are mapped on their own and given back when freed."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 256 << 10)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 1 << 20)


def trim() -> None:
    """Give free heap memory back to the system (glibc's malloc_trim: a few milliseconds)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
