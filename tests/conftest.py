"""Shared fixtures: a real `reefd` subprocess on a free loopback port, serving the tiny model."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from tests import served
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
    proof: bool = False  # the release proof as the scenario files say; else off (see `unproven`)

    def start(self, wait_ready: bool = True) -> None:
        self._seed_tiny()
        if not self.proof:
            unproven_groups(self.scenarios)
            for path in self.scenarios.glob("*.yaml"):
                path.write_text(unproven(path.read_text()))
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

    def reload(self, timeout_s: float = 180.0) -> None:
        """SIGHUP (`systemctl reload reefd`), then until reefd says it applied its scenarios folder and is ready
        again (every scenario bound to its release); a folder it refuses fails here with its log."""
        assert self.proc is not None and self.proc.poll() is None, self.logs()

        def counts() -> tuple[int, int]:
            text = self.log_path.read_text(errors="replace")
            return text.count("reloaded scenarios:"), text.count("reload refused") + text.count("reload failed")

        done, refused = counts()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while (now := counts())[0] == done:
            if now[1] != refused:
                raise AssertionError(f"reefd refused its scenarios folder:\n{self.logs()}")
            assert time.monotonic() < deadline, f"no reload in {timeout_s} s:\n{self.logs()}"
            time.sleep(0.05)
        self.wait_ready(max(1.0, deadline - time.monotonic()))


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


def unproven(text: str) -> str:
    """A scenario whose release settings come from the `release` group (added to its defaults if it has none: the
    group's settings are ReleaseConfig's own defaults), where a daemon started without `proof` turns the release
    proof off. The suite's daemons that do not test the proof so skip its reference process (about 6 s of CPU for
    each daemon that publishes, then a fingerprint per candidate) and the trainer's fingerprint of every job; the
    proof's own tests keep it (`Daemon(proof=True)`, `own_scenario(..., proof=True)`), and so do those where a
    release is loaded again or beside another (canaries, restarts, replica repair, bundles, practice)."""
    try:
        cfg = OmegaConf.create(text)
        defaults = cfg.get("defaults")
        if defaults is None or "_self_" not in defaults or any(
                isinstance(d, DictConfig) and "release" in d for d in defaults):
            return text
        defaults.insert(list(defaults).index("_self_"), {"release": "follow"})
        return OmegaConf.to_yaml(cfg)
    except Exception:  # a file a test writes broken on purpose stays as it is
        return text


def proven(text: str) -> str:
    """A scenario that proves its releases whatever its `release` group says."""
    cfg = OmegaConf.create(text)
    OmegaConf.update(cfg, "release.proof.enabled", True, force_add=True)
    return OmegaConf.to_yaml(cfg)


def unproven_groups(scenarios: Path) -> None:
    """The scenario folder's `release` group options, with the release proof off (see `unproven`)."""
    for path in (scenarios / "release").glob("*.yaml"):
        text = path.read_text()
        if "proof:" not in text:
            path.write_text(text + "proof:\n  enabled: false\n")


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


_NAMES = itertools.count(1)


@pytest.fixture
def own_scenario() -> Iterator[Callable[..., str]]:
    """Adds a scenario of the test's own to a shared daemon: `own_scenario(d, text, prefix="s", files={...})`
    writes NAME.yaml (and `files`, relative to the scenarios folder) and reloads; returns NAME, unique in the
    session. At the test's end its unfinished jobs are cancelled, its files removed and reefd reloaded, so the
    next test finds the daemon serving what it served before (with this scenario's records and releases kept)."""
    added: list[tuple[Daemon, str, list[Path]]] = []

    def add(d: Daemon, text: str, prefix: str = "s", files: dict[str, str] | None = None, proof: bool = False) -> str:
        name = f"{prefix}-{next(_NAMES)}"
        paths = [d.scenarios / f"{name}.yaml"]
        for rel, content in (files or {}).items():
            paths.append(d.scenarios / rel)
            paths[-1].write_text(content)
        paths[0].write_text(proven(text) if proof else unproven(text))
        added.append((d, name, paths))
        d.reload()
        return name

    yield add
    for d, name, paths in reversed(added):
        alive = d.proc is not None and d.proc.poll() is None
        if alive:
            cancel_jobs(d, name)
        for path in paths:
            path.unlink(missing_ok=True)
        if alive:
            d.reload()


def cancel_jobs(d: Daemon, scenario: str) -> None:
    """Cancel a scenario's queued and running jobs (reefd runs one job at a time, across every scenario)."""
    listed = json.loads(d.get(f"/reef/jobs?scenario={scenario}")[1])["data"]
    for job in listed:
        if job["state"] in ("queued", "running"):
            d.post(f"/reef/jobs/{job['id']}/cancel", {})


def shared_daemon(base: Path, names: tuple[str, ...] = ("tiny",), extra: dict[str, str] | None = None,
                  env: dict[str, str] | None = None, files: dict[str, str] | None = None,
                  ready_s: float = 180.0, proof: bool = False) -> Iterator[Daemon]:
    """The body of a module's shared-daemon fixture: one reefd for the module, a scenario per test
    (`own_scenario`); `files`: more files in its scenarios folder (path -> text); `proof`: releases proven as
    the scenarios say (see `unproven`). Tests of the process itself (signals, restarts, kills) keep a daemon of
    their own."""
    scenarios = make_scenarios(base / "scenarios", names=names, extra=extra)
    for rel, text in (files or {}).items():
        (scenarios / rel).parent.mkdir(parents=True, exist_ok=True)
        (scenarios / rel).write_text(text)
    d = Daemon(scenarios=scenarios, state=base / "state", log_path=base / "reefd.log", env=env or {}, proof=proof)
    try:  # a daemon that never got ready is stopped too, with its engines: they would slow every later test
        d.start(wait_ready=False)
        d.wait_ready(ready_s)
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model, built once per session by the worker's own preparation command."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "reefd.worker.prepare", "tiny", "--out", str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session", autouse=True)
def _tiny_for_daemons(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test daemon starts with the session's tiny model (see Daemon._seed_tiny); a session without e2e
    tests (`make check`) does not build it."""
    if not any(item.get_closest_marker("e2e") for item in request.session.items):
        yield
        return
    os.environ["REEF_TEST_TINY"] = str(request.getfixturevalue("tiny_model"))
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


E2E = ROOT / "tests" / "e2e"
# reefd, an engine worker, a Ray head, or the tiny model itself (real weights: a trainer, an in-process engine)
E2E_FIXTURES = frozenset({"daemon", "fresh_daemon", "own_scenario", "worker", "fresh_worker", "ray_head",
                          "tiny_model", "engine"})


def _starts_processes(item: pytest.Item) -> bool:
    """Whether a test is of the slow tier: it lives in tests/e2e, uses one of E2E_FIXTURES, or its module holds a
    class that launches reefd or an engine worker (Daemon, Worker)."""
    if item.path.is_relative_to(E2E) or E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(isinstance(v, type) and issubclass(v, Served) and v is not Served
                                      for v in vars(module).values())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `e2e` every test of the slow tier (`make check` runs the others; `make test` runs all)."""
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.e2e)


_current: list[pytest.Item] = []  # the test being set up, run or torn down


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


def _check_launch(proc: Served) -> None:
    """A test not marked `e2e` may not start reefd or a worker: the mark is what keeps `make check` fast."""
    if _current and _current[-1].get_closest_marker("e2e") is None:
        raise RuntimeError(f"{_current[-1].nodeid} starts a {type(proc).__name__} process but is not marked e2e; "
                           "see _starts_processes in tests/conftest.py")


def pytest_configure(config: pytest.Config) -> None:
    served.on_launch = _check_launch
    # Two test processes share this machine's two cores (make test's -n auto), and every reefd, engine worker and
    # trainer they start runs torch on the tiny model, whose ops are too small to gain from threads: one thread
    # each, so that they do not spin against each other (inherited by every process the suite starts; a caller's
    # own setting wins). Set here, not at import: the benchmarks import this module and keep every core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: tell the controller
    if workeroutput is not None:
        workeroutput["launches"] = dict(served.LAUNCHES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """(pytest-xdist's controller) add up what each worker launched."""
    served.LAUNCHES.update(getattr(node, "workeroutput", {}).get("launches", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many reefd and engine worker processes the session started: the suite's time follows this count."""
    terminalreporter.write_line(f"reefd daemon starts: {served.LAUNCHES['Daemon']}, "
                                f"engine worker starts (tests/worker): {served.LAUNCHES['Worker']}")
