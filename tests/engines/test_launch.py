"""An engine process started either way (forked from the fork server, or executed) looks the same to itself and
to the supervisor: `python -m M args` semantics, its own session, the environment it was given, its exit code to
every waiter, SIGTERM on terminate."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reefd.engines import launch as launching
from reefd.engines.launch import Forked, launch

CHILD = "tests.engines.launched_child"


@pytest.fixture(params=["forked", "executed"])
def how(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "forked":
        monkeypatch.setattr(launching, "FORKED", frozenset({CHILD}))
    else:
        monkeypatch.setenv("REEF_FORKSERVER", "0")
    yield request.param


def seen(out: Path, timeout_s: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while not out.exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.02)
    return dict(json.loads(out.read_text()))


def test_argv_session_environment_and_exit_code(how: str, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"

    async def go() -> tuple[int, int, int, object]:
        proc = await launch([sys.executable, "-m", CHILD, str(out), "3", "0.3"], {"ONLY": "this", "PATH": "/bin"})
        assert proc.returncode is None
        first, second = await asyncio.gather(proc.wait(), proc.wait())  # two waiters, one exit code
        return first, second, proc.pid, type(proc)

    first, second, pid, kind = asyncio.run(go())
    assert first == second == 3
    assert (kind is Forked) == (how == "forked")
    child = seen(out)
    assert child["argv"] == [str(out), "3", "0.3"] and child["pid"] == pid
    assert child["sid"] == pid  # a session and group of its own: the supervisor kills the group
    assert child["stdin"] == "/dev/null"
    env = child["env"]
    assert isinstance(env, dict) and env["ONLY"] == "this" and "REEF_FORKSERVER" not in env


def test_terminate_and_a_waiter_that_timed_out(how: str, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"

    async def go() -> int:
        proc = await launch([sys.executable, "-m", CHILD, str(out), "0", "60"], None)
        await asyncio.to_thread(seen, out)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(proc.wait(), 0.2)  # a timed-out wait leaves the next one working
        proc.terminate()
        return await asyncio.wait_for(proc.wait(), 30)

    assert asyncio.run(go()) == -signal.SIGTERM
    assert "REEF_FORKSERVER" not in seen(out)["env"] or how == "executed"


def test_a_waiter_wakes_when_another_caller_sees_the_exit_first(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """The supervisor reads a forked process's `returncode` while its watch awaits `wait()`: whichever learns of
    the exit first, the other is told too. (asyncio's Process learns of it only on the loop.)"""
    monkeypatch.setattr(launching, "FORKED", frozenset({CHILD}))
    out = tmp_path / "seen.json"

    async def go() -> int:
        proc = await launch([sys.executable, "-m", CHILD, str(out), "4", "0"], None)
        waiter = asyncio.create_task(proc.wait())
        await asyncio.sleep(0)  # the waiter is watching
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the loop blocked: the exit report waits unread
        time.sleep(1.0)
        while proc.returncode is None and time.monotonic() < deadline:  # read here first
            time.sleep(0.05)
        return await asyncio.wait_for(waiter, 30)

    assert asyncio.run(go()) == 4


def test_a_fork_server_killed_alone_takes_no_process_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kill -9 of the fork server: its child goes on (it ends with reefd, not with the server), its waiter is
    told when it does end (its code then unknown: SERVER_GONE), and the next launch starts a new server."""
    monkeypatch.setattr(launching, "FORKED", frozenset({CHILD}))
    out, again = tmp_path / "seen.json", tmp_path / "again.json"

    async def go() -> tuple[int, int]:
        proc = await launch([sys.executable, "-m", CHILD, str(out), "0", "60"], None)
        await asyncio.to_thread(seen, out)
        server = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGKILL)
        waiter = asyncio.create_task(proc.wait())
        await asyncio.sleep(1.0)  # the server's death has reached the child and the sentinel
        assert proc.returncode is None and not waiter.done()  # it still runs, and is still watched
        os.kill(proc.pid, 0)
        next_one = await launch([sys.executable, "-m", CHILD, str(again), "5", "0"], None)  # a new server
        proc.terminate()
        return await asyncio.wait_for(waiter, 30), await asyncio.wait_for(next_one.wait(), 60)

    ended, code = asyncio.run(go())
    assert ended == launching.SERVER_GONE and code == 5 and seen(again)["argv"] == [str(again), "5", "0"]


def test_other_programs_are_executed(tmp_path: Path) -> None:
    async def go() -> tuple[object, int]:
        proc = await launch([sys.executable, "-c", "raise SystemExit(7)"], None)
        return type(proc), await proc.wait()

    kind, code = asyncio.run(go())
    assert kind is asyncio.subprocess.Process and code == 7


def marked(mark: str) -> list[int]:
    """Processes whose environment holds `mark` (the fork server, its children, multiprocessing's tracker)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/environ").read_bytes() and \
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("when", ["importing", "serving"])
def test_nothing_outlives_a_launcher_killed_by_sigkill(tmp_path: Path, when: str) -> None:
    """Killed while the fork server still imports (its request queued), or once the child runs: the server and
    the child go too."""
    mark = f"REEF_TEST_MARK={uuid.uuid4().hex}"
    out = tmp_path / "seen.json"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1]}
    with subprocess.Popen([sys.executable, "-m", "tests.engines.launching_parent", str(out)], env=env,
                          stdout=subprocess.PIPE, text=True) as parent:
        try:
            if when == "importing":
                time.sleep(0.3)
            else:
                assert parent.stdout is not None and parent.stdout.readline().strip().isdigit()
                seen(out)
            assert marked(mark), "the fork server never started"
        finally:
            parent.kill()
    deadline = time.monotonic() + 30
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked(mark), f"left running after the launcher's SIGKILL: {marked(mark)}"
