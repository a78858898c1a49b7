"""sd_notify: datagrams to $NOTIFY_SOCKET, and the daemon's READY / RELOADING / STOPPING."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reefd.ops import systemd
from tests.conftest import ROOT, Daemon, make_scenarios


def listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(120)
    return sock


def test_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False


def test_notify_sends_one_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with listen(tmp_path / "n.sock") as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
        assert systemd.notify("READY=1", "STATUS=serving")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_daemon_tells_systemd_ready_reloading_stopping(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with listen(path) as sock:
        d = Daemon(scenarios=make_scenarios(tmp_path / "s"), state=tmp_path / "state",
                   log_path=tmp_path / "reefd.log", env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
        d.start()
        try:
            pings = 0

            def until(prefix: str) -> str:
                nonlocal pings
                while True:
                    msg = sock.recv(4096).decode()
                    pings += msg == "WATCHDOG=1"
                    if msg.startswith(prefix):
                        return msg

            assert "STATUS=serving 1 scenario" in until("READY=1")
            for _ in range(3):
                until("WATCHDOG=1")  # every WatchdogSec/2 = 0.2 s
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            reloading = until("RELOADING=1")
            assert "MONOTONIC_USEC=" in reloading and "STATUS=reloading scenarios" in reloading
            assert "STATUS=serving 1 scenario" in until("READY=1")
            d.proc.send_signal(signal.SIGTERM)
            until("STOPPING=1")
            assert d.proc.wait(60) == 0
        finally:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


def test_the_watchdog_pings_from_the_event_loop_and_not_while_it_is_stuck(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """WATCHDOG=1 comes from a task on the loop: while a callback blocks the loop, no ping goes out, so systemd
    (WatchdogSec=) restarts a reefd whose loop is stuck."""
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() == 0.05
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd.watchdog_interval() is None  # meant for another process
    monkeypatch.delenv("WATCHDOG_PID")
    arrivals: list[float] = []
    with listen(tmp_path / "w.sock") as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "w.sock"))
        sock.settimeout(0.05)
        done = threading.Event()

        def receive() -> None:
            while not done.is_set():
                try:
                    if sock.recv(64) == b"WATCHDOG=1":
                        arrivals.append(time.monotonic())
                except TimeoutError:
                    continue

        reader = threading.Thread(target=receive)
        reader.start()

        async def main() -> tuple[float, float]:
            task = asyncio.create_task(systemd.watchdog(0.05))
            await asyncio.sleep(0.3)
            stuck = time.monotonic()
            time.sleep(0.6)  # a callback that never yields: the loop is stuck
            freed = time.monotonic()
            await asyncio.sleep(0.3)
            task.cancel()
            return stuck, freed

        stuck, freed = asyncio.run(main())
        done.set()
        reader.join()
    assert sum(t < stuck for t in arrivals) >= 3 and sum(t > freed for t in arrivals) >= 3
    assert not [t for t in arrivals if stuck + 0.1 < t < freed]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_unit_verifies_and_its_exposure_stays_low(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "reefd.service").read_text()
    reefd = Path(sys.executable).parent / "reefd"  # ExecStart must name a program that exists here
    (tmp_path / "reefd.service").write_text(unit.replace("/opt/reef/.venv/bin/reefd", str(reefd)))
    verify = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "reefd.service")], capture_output=True,
                            text=True)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    security = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(tmp_path / "reefd.service")],
                              capture_output=True, text=True)
    found = re.search(r"Overall exposure level for reefd\.service: (\d+\.\d+)", security.stdout)
    if found is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit offline: {security.stderr.strip()[:200]}")
    assert float(found.group(1)) <= 2.0, security.stdout
