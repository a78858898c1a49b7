"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The session's Ray head: (dashboard URL, token file)."""
    tmp = tmp_path_factory.mktemp("ray")
    # Ray's sockets live under its temp dir and a socket path holds at most 107 bytes: a short dir of its own
    short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    token = tmp / "token"
    token.write_text(secrets.token_hex(16))
    dashboard = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    ray = Path(sys.executable).with_name("ray")
    head_log = (tmp / "head.log").open("wb")
    proc = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--temp-dir", str(short), "--port", str(free_port()),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--node-ip-address", "127.0.0.1",
         "--ray-client-server-port", str(free_port()), "--num-cpus", "2", "--include-dashboard", "true",
         # ports of its own, so heads in parallel test processes (pytest-xdist) never meet on a default one
         "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
         "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
         "--disable-usage-stats"],
        env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            req = urllib.request.Request(url + "/api/version", headers={"Authorization": f"Bearer {token.read_text()}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()[-3000:]
            time.sleep(0.25)
        yield url, token
    finally:
        with contextlib.suppress(ProcessLookupError):  # the head and everything it started: its process group
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a test head has nothing to save: 3 s is plenty
            proc.wait(3)
        with contextlib.suppress(ProcessLookupError):  # whatever did not stop on SIGTERM
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)
        head_log.close()
        shutil.rmtree(short, ignore_errors=True)
