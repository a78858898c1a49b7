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


PARENT = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[3], "w").write(str(child.pid))
exec(compile(sys.argv[4], "engine", "exec"), {"__name__": "__main__"} | {"sys": sys})
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_what_an_engine_started_dies_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine server that starts processes of its own (vLLM's engine core and workers) and is killed outright
    leaves none of them behind: the supervisor kills its whole process group, on a crash and on stop."""
    monkeypatch.setattr(Supervisor, "HEALTH_INTERVAL_S", 0.2)
    child_file = tmp_path / "child"

    async def go() -> None:
        sup = Supervisor("fake", lambda port: [sys.executable, "-c", PARENT, str(port), str(tmp_path / "sick"),
                                               str(child_file), ENGINE], healthy, startup_timeout_s=30)
        sup.start()
        await until(lambda: sup.state == "ready")
        child = int(child_file.read_text())
        assert alive(child)
        os.kill(sup.pid or 0, signal.SIGKILL)  # the server dies; its child would be left to init
        await until(lambda: not alive(child))
        await until(lambda: sup.restarts == 1 and sup.state == "ready")
        second = int(child_file.read_text())
        assert second != child and alive(second)
        await sup.stop()
        await until(lambda: not alive(second))

    asyncio.run(go())


def test_secrets_are_masked_in_logged_command_lines() -> None:
    from reefd.engines.supervisor import masked

    argv = ["python", "-m", "sglang.launch_server", "--api-key", "s3cret", "--port", "1",
            "--hf-token=abc", "--model-path", "/m"]
    assert masked(argv) == ["python", "-m", "sglang.launch_server", "--api-key", "***",
                            "--port", "1", "--hf-token=***", "--model-path", "/m"]
