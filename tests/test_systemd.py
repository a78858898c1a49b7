"""sd_notify: datagrams to $NOTIFY_SOCKET, and the daemon's READY / RELOADING / STOPPING."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from reefd import systemd
from tests.conftest import Daemon, make_scenarios


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
                   log_path=tmp_path / "reefd.log", env={"NOTIFY_SOCKET": str(path)})
        d.start()
        try:
            def until(prefix: str) -> str:
                while True:
                    msg = sock.recv(4096).decode()
                    if msg.startswith(prefix):
                        return msg

            assert "STATUS=serving" in until("READY=1")
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            reloading = until("RELOADING=1")
            assert "MONOTONIC_USEC=" in reloading
            until("READY=1")
            d.proc.send_signal(signal.SIGTERM)
            until("STOPPING=1")
            assert d.proc.wait(60) == 0
        finally:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
