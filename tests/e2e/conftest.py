"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Ray head of the test's own: (dashboard URL, token file)."""
    tmp = tmp_path_factory.mktemp("ray")
    token = tmp / "token"
    token.write_text(secrets.token_hex(16))
    dashboard = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    ray = Path(sys.executable).with_name("ray")
    head_log = (tmp / "head.log").open("wb")
    proc = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--temp-dir", str(tmp / "t"), "--port", str(free_port()),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--node-ip-address", "127.0.0.1",
         "--ray-client-server-port", str(free_port()), "--num-cpus", "2", "--include-dashboard", "true",
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
