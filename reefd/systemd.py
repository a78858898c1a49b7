"""sd_notify without libsystemd: READY/RELOADING/STOPPING/STATUS datagrams to $NOTIFY_SOCKET.

A no-op when reefd does not run under systemd. Knows nothing else about the daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket

SEND_TIMEOUT_S = 10.0


def notify(*lines: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
        except OSError:  # no listener, or one that has not read for SEND_TIMEOUT_S: best effort, as sd_notify
            return False
    return True


async def notify_async(*lines: str) -> bool:
    """`notify` off the event loop: a datagram blocks while the receiver's queue is full (10 datagrams by
    default), and that must stall one thread, never the daemon."""
    return await asyncio.to_thread(notify, *lines)
