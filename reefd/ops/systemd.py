"""sd_notify without libsystemd: READY/RELOADING/STOPPING/STATUS/WATCHDOG datagrams to $NOTIFY_SOCKET.

A no-op when reefd does not run under systemd. Knows nothing else about the daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket

SEND_TIMEOUT_S = 10.0


def notify(*lines: str, timeout_s: float = SEND_TIMEOUT_S) -> bool:
    """Send `lines` as one datagram; False when nobody listens (or, past `timeout_s`, reads)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
        except OSError:  # no listener, or one that has not read for timeout_s: best effort, as sd_notify
            return False
    return True


async def notify_async(*lines: str) -> bool:
    """`notify` off the event loop: a datagram blocks while the receiver's queue is full (10 datagrams by
    default), and that must stall one thread, never the daemon."""
    return await asyncio.to_thread(notify, *lines)


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of the unit's WatchdogSec, as sd_watchdog_enabled advises), or None
    when systemd does not watch this process."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid.isdigit() and int(pid) != os.getpid():  # meant for another process (reefd was not the main one)
        return None
    return int(usec) / 2e6


async def watchdog(interval_s: float) -> None:
    """WATCHDOG=1 every `interval_s`, sent by the event loop itself, never from a thread: a loop stuck for
    WatchdogSec sends nothing, and systemd restarts reefd. The send never waits (a full receiver queue skips a
    ping rather than block the loop)."""
    while True:
        notify("WATCHDOG=1", timeout_s=0)
        await asyncio.sleep(interval_s)
