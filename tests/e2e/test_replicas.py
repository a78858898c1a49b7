"""Engine replicas behind the real sglang-router, through the real daemon and real worker processes on the tiny
model: every replica joins the router with the serving adapters, sessions stick to a replica, adapter releases
reach every replica, and a replica killed with kill -9 leaves the router, is restarted with the serving adapter
and joins again while the other one keeps serving."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_daemon import _stream_lines
from tests.e2e.test_grow import stop
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

SCENARIO = """defaults:
  - model: tiny
  - _self_
model:
  replicas: 2
serve:
  default_max_tokens: 3
"""
REP = {"x-reef-scenario": "rep"}


def replicas(d: Daemon) -> list[dict[str, Any]]:
    status = json.loads(d.get("/reef/status")[1])
    return list(status["scenarios"][0]["engine"]["replicas"])


def wait_for(d: Daemon, ok: Any, what: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = replicas(d)
        if ok(found):
            return found
        time.sleep(0.3)
    raise AssertionError(f"replicas never {what}: {replicas(d)}\n{d.logs()[-3000:]}")


def ask(d: Daemon, session: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    return d.post("/v1/chat/completions", {"model": "rep", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2}, headers={**REP, "x-reef-session": session})


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ppid(pid: int) -> int | None:
    try:
        return parent(pid)
    except (OSError, ValueError, IndexError):
        return None


def served(d: Daemon) -> dict[str, int]:
    return {r["url"]: r["requests"] or 0 for r in replicas(d)}


def test_replicas_behind_the_router(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"rep": SCENARIO})
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log", proof=True)
    d.start()
    try:
        all_in = wait_for(d, lambda rs: all(r["in_router"] and r["healthy"] for r in rs), "all joined")
        assert len(all_in) == 2 and len({r["url"] for r in all_in}) == 2
        assert d.get("/readyz")[0] == 200

        # a session sticks to one replica
        for session in ("alpha", "beta", "gamma"):
            before = served(d)
            for _ in range(4):
                code, body, _ = ask(d, session)
                assert code == 200, body
            after = served(d)
            grew = {url: after[url] - before[url] for url in after}
            assert sorted(grew.values()) == [0, 4], (session, grew)

        # an adapter release reaches every replica
        lora = make_lora(d.state / "models" / "tiny", tmp_path / "lora", seed=3, scale=2.0)
        out = reefctl(d, "publish", "rep", "--adapter", str(lora), "-o", "json")
        assert out.returncode == 0, out.stderr
        release = json.loads(out.stdout)["release"]["id"]
        loaded = wait_for(d, lambda rs: all(r["adapters"] for r in rs), "all loaded the adapter")
        assert {tuple(r["adapters"]) for r in loaded} == {tuple(loaded[0]["adapters"])}
        code, _, headers = ask(d, "alpha")
        assert code == 200 and headers["x-reef-release-id"] == release

        # a replica that lost the adapter is repaired by the reconcile pass
        adapter = loaded[1]["adapters"][0]
        req = urllib.request.Request(loaded[1]["url"] + "/unload_lora_adapter", data=json.dumps(
            {"lora_name": adapter}).encode(), headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["success"]
        assert replicas(d)[1]["adapters"] == []
        wait_for(d, lambda rs: rs[1]["adapters"] == [adapter], "repaired the lost adapter", 40)
        engine = json.loads(d.get("/reef/status")[1])["scenarios"][0]["engine"]
        assert engine["repairs"] >= 1

        # kill -9 one replica: it leaves the router, the other serves, and it comes back with the adapter
        victim = loaded[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(d, lambda rs: not rs[0]["in_router"] or rs[0]["pid"] != victim["pid"], "noticed the kill", 60)
        status = reefctl(d, "status")
        assert status.returncode == 0
        for i in range(6):
            code, body, headers = ask(d, f"after-kill-{i}")
            assert code == 200, body
            assert headers["x-reef-release-id"] == release
        back = wait_for(d, lambda rs: rs[0]["in_router"] and rs[0]["healthy"] and rs[0]["pid"] != victim["pid"]
                        and rs[0]["adapters"], "restarted and rejoined", 120)
        assert back[0]["restarts"] == 1 and back[0]["adapters"] == loaded[0]["adapters"]
        assert json.loads(d.get("/reef/status")[1])["scenarios"][0]["engine"]["state"] == "ready"
        text = reefctl(d, "status").stderr + reefctl(d, "status").stdout
        assert "replica 0" in text and "replica 1" in text and f"release {release}" in text

        # kill -9 of the fork server the replicas were forked from fails no request, and takes neither replica
        # down; a replica that ends after that is started again from a new server
        before = wait_for(d, lambda rs: all(r["in_router"] and r["healthy"] for r in rs), "all back", 60)
        servers = {parent(r["pid"]) for r in before}
        assert len(servers) == 1 and d.proc is not None and d.proc.pid not in servers  # the server's children
        os.kill(servers.pop(), signal.SIGKILL)
        answers = [ask(d, f"server-gone-{i}") for i in range(24)]
        assert [code for code, _, _ in answers] == [200] * 24, [body for code, body, _ in answers if code != 200]
        after = replicas(d)
        assert [r["pid"] for r in after] == [r["pid"] for r in before], (before, after)
        assert all(r["in_router"] and r["healthy"] and r["restarts"] == b["restarts"]
                   for r, b in zip(after, before, strict=True)), after
        os.kill(after[1]["pid"], signal.SIGKILL)
        wait_for(d, lambda rs: rs[1]["pid"] != after[1]["pid"] and rs[1]["in_router"] and rs[1]["healthy"]
                 and rs[1]["adapters"], "restarted the replica from a new fork server", 120)

        # kill -9 of the router fails no request either: while it is down (or before reefd notices), requests go
        # straight to a replica, and the router comes back with both
        router = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _ppid(pid) == d.proc.pid
                  and b"router" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(router) == 1, router
        os.kill(router[0], signal.SIGKILL)
        answers = [ask(d, f"router-gone-{i}") for i in range(24)]
        assert [code for code, _, _ in answers] == [200] * 24, [body for code, body, _ in answers if code != 200]
        wait_for(d, lambda rs: all(r["in_router"] and r["healthy"] for r in rs), "rejoined a new router", 120)

        # a stream cut by its dying replica ends with an error event, and its record says what happened
        lines: list[str] = []
        started = threading.Event()
        t = threading.Thread(target=_stream_lines, args=(d, "rep", lines, started, 4000, {"x-reef-session": "long"}))
        t.start()
        assert started.wait(60)
        busy = wait_for(d, lambda rs: any((r["load"] or 0) > 0 for r in rs), "showed the stream's load", 30)
        os.kill(next(r["pid"] for r in busy if (r["load"] or 0) > 0), signal.SIGKILL)
        t.join(60)
        assert not t.is_alive() and "data: [DONE]" not in lines
        assert json.loads(lines[-1][len("data: "):])["error"]["type"] == "server_error", lines[-3:]
        record = json.loads(d.get(f"/reef/records/{lines[0].split(': ', 1)[1]}")[1])
        assert record["finish_reason"] == "error" and record["error"]["code"] == "engine_error", record.get("error")
    finally:
        stop(d)
