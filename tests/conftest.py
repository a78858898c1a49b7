"""Shared fixtures: a real `reefd` subprocess on a free loopback port, serving the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.served import ROOT, Served, free_port

TOKEN = "test-token-" + "x" * 16


@dataclass
class Daemon(Served):
    """A running reefd: its URL, token, folders and process, with restart/kill helpers."""

    scenarios: Path
    state: Path
    log_path: Path
    token: str = TOKEN
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    seed_tiny: bool = True

    def start(self, wait_ready: bool = True) -> None:
        self._seed_tiny()
        env = {**os.environ, "REEF_TOKEN": self.token, "REEF_LOG_LEVEL": "INFO", **self.env}
        env.pop("REEF_URL", None)
        self.launch([sys.executable, "-m", "reefd", "--scenarios", str(self.scenarios),
                     "--state", str(self.state), "--listen", f"127.0.0.1:{self.port}"], env)
        if wait_ready:
            self.wait_ready()

    def _seed_tiny(self) -> None:
        """Start with the session's tiny model (REEF_TEST_TINY, built once), as a restarted reefd finds it in its
        state folder: preparing it again takes seconds at every daemon's first start. A test that must see
        reefd prepare it sets `seed_tiny` to False."""
        cache = os.environ.get("REEF_TEST_TINY")
        target = self.state / "models" / "tiny"
        if self.seed_tiny and cache and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(cache, target)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def post(self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
             token: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"Authorization": f"Bearer {token or self.token}", "x-reef-scenario": "tiny",
                "content-type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, headers=hdrs, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        self.wait_for("/readyz", timeout_s)


def make_scenarios(dst: Path, names: tuple[str, ...] = ("tiny",), extra: dict[str, str] | None = None
                   ) -> Path:
    """A scenario folder with the project's config groups and a chosen subset of scenarios."""
    dst.mkdir(parents=True, exist_ok=True)
    for group in (ROOT / "scenarios").iterdir():
        if group.is_dir():
            shutil.copytree(group, dst / group.name, dirs_exist_ok=True)
    for name in names:
        shutil.copy(ROOT / "scenarios" / f"{name}.yaml", dst / f"{name}.yaml")
    for name, text in (extra or {}).items():
        (dst / f"{name}.yaml").write_text(text)
    return dst


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One reefd for the session's read-mostly end-to-end tests."""
    base = tmp_path_factory.mktemp("reefd")
    d = Daemon(scenarios=make_scenarios(base / "scenarios"), state=base / "state",
               log_path=base / "reefd.log")
    d.start()
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A reefd of the test's own, for tests that stop, kill or restart it."""
    d = Daemon(scenarios=make_scenarios(tmp_path / "scenarios"), state=tmp_path / "state",
               log_path=tmp_path / "reefd.log")
    yield d
    if d.proc is not None and d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model, built once per session by the worker's own preparation command."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "reefd.worker.prepare", "tiny", "--out", str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session", autouse=True)
def _tiny_for_daemons(tiny_model: Path) -> Iterator[None]:
    """Every test daemon starts with the session's tiny model (see Daemon._seed_tiny)."""
    os.environ["REEF_TEST_TINY"] = str(tiny_model)
    yield
    os.environ.pop("REEF_TEST_TINY", None)


_SDK_CLIENTS: list[Any] = []


def sdk(client: Any) -> Any:
    """Keep an SDK client alive until the session ends, then close it (no ResourceWarning)."""
    _SDK_CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True, scope="session")
def _close_sdk_clients() -> Iterator[None]:
    yield
    for client in _SDK_CLIENTS:
        client.close()


def base_release(d: Daemon, scenario: str = "tiny") -> str:
    """The id of the release a scenario serves (its base release, in these tests)."""
    status = json.loads(d.get("/reef/status")[1])
    release = next(s["release"] for s in status["scenarios"] if s["name"] == scenario)
    assert isinstance(release, str) and release.startswith("r0-")
    return release
