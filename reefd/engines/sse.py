"""Reads a server-sent event stream: the payload of each `data:` line, however long the line is.

aiohttp's line reader refuses a line past its buffer limit; an engine may send one event with a
whole long answer in it (SGLang's default streaming repeats the answer so far on every event).
Knows nothing about what the payloads mean.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

MAX_EVENT_BYTES = 256 << 20  # past this an event is a broken engine, not an answer


class EventTooLarge(ValueError):
    pass


async def data_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stripped payload of every `data:` line of `content`, in order."""
    buffer = bytearray()
    scanned = 0  # bytes of `buffer` known to hold no newline
    async for chunk in content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n", scanned)) >= 0:
            line = bytes(buffer[:end]).strip()
            del buffer[: end + 1]
            scanned = 0
            if line.startswith(b"data:"):
                yield line[5:].strip()
        scanned = len(buffer)
        if scanned > MAX_EVENT_BYTES:
            raise EventTooLarge(f"an event of the stream passed {MAX_EVENT_BYTES >> 20} MiB without ending")
    line = bytes(buffer).strip()
    if line.startswith(b"data:"):
        yield line[5:].strip()
