"""sd_notify without libsystemd: READY/RELOADING/STOPPING/STATUS datagrams to $NOTIFY_SOCKET.

A no-op when reefd does not run under systemd. Knows nothing else about the daemon.
"""

from __future__ import annotations

import os
import socket


def notify(*lines: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall("\n".join(lines).encode())
    return True
