"""A server subprocess on a free loopback port: launch, wait for a ready path, logs, stop.

Shared by the reefd fixtures (tests/conftest.py) and the worker's (tests/worker/support.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import socket
import socketserver
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent

LAUNCHES: collections.Counter[str] = collections.Counter()  # processes launched, by class (Daemon, Worker)
on_launch: Callable[[Served], None] | None = None  # the test session's check before each launch (tests/conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """Subclasses set `port`, `log_path` and `proc` (dataclass fields) and call `launch`."""

    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        if on_launch is not None:
            on_launch(self)
        LAUNCHES[type(self).__name__] += 1
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT)

    def headers(self) -> dict[str, str]:
        return {}

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        headers = self.headers() if token is None else {"Authorization": f"Bearer {token}"}
        req = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_for(self, path: str, timeout_s: float) -> None:
        """Until GET path answers 200; a process that exits first fails with its log."""
        name = type(self).__name__
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.get(path)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready in {timeout_s} s:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout_s)
        return int(self.proc.returncode)


@contextlib.contextmanager
def in_thread(server: socketserver.BaseServer) -> Iterator[None]:
    """Serve a stdlib HTTP server (a canned fake) from a thread for the duration of the block."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@contextlib.contextmanager
def aiohttp_in_thread(app: web.Application) -> Iterator[str]:
    """Serve an aiohttp app on a free loopback port from a thread; yields its base URL."""
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
