"""Supervisor: launch, readiness by health, restart on exit and on a process that stops answering."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from reefd.engines.supervisor import Supervisor

ENGINE = r"""
import http.server, os, sys
port, sick = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(500 if os.path.exists(sick) else 200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


async def healthy(url: str) -> bool:
    def get() -> bool:
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    return await asyncio.to_thread(get)


async def until(predicate: object, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def test_restarts_after_exit_and_after_failed_health(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Supervisor, "HEALTH_INTERVAL_S", 0.2)
    sick = tmp_path / "sick"

    async def go() -> None:
        sup = Supervisor("fake", lambda port: [sys.executable, "-c", ENGINE, str(port), str(sick)],
                         healthy, startup_timeout_s=30)
        sup.start()
        await until(lambda: sup.state == "ready")
        first = sup.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)  # dies: restarted
        await until(lambda: sup.restarts == 1 and sup.state == "ready")
        second = sup.pid
        assert second != first and "exited" in (sup.last_error or "")
        sick.touch()  # alive but failing health: killed and restarted
        await until(lambda: sup.restarts >= 2)
        assert "health" in (sup.last_error or "")
        sick.unlink()
        await until(lambda: sup.state == "ready" and sup.pid != second)
        last = sup.pid
        await sup.stop()
        assert sup.state == "stopped"
        assert last is not None
        with pytest.raises(ProcessLookupError):
            os.kill(last, 0)

    asyncio.run(go())


def test_secrets_are_masked_in_logged_command_lines() -> None:
    from reefd.engines.supervisor import masked

    argv = ["python", "-m", "sglang.launch_server", "--api-key", "s3cret", "--port", "1",
            "--hf-token=abc", "--model-path", "/m"]
    assert masked(argv) == ["python", "-m", "sglang.launch_server", "--api-key", "***",
                            "--port", "1", "--hf-token=***", "--model-path", "/m"]
