"""Scoped tokens against a running reefd: every route × every scope, scenario limits, and rotation by SIGHUP.

Contract test for the serving part: the scenarios pass through to tests/fake_upstream.py (no model needed to
check who may call what). The tokens are made with the real `reefctl token` command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reefd.ops.tokens import SCOPES
from tests.conftest import TOKEN, Daemon, make_scenarios
from tests.fake_upstream import build
from tests.served import aiohttp_in_thread

pytestmark = pytest.mark.contract

# The scope each route needs, written out here (not read from reefd) so that the test states the matrix.
# Paths are aiohttp's canonical ones; {name}/{scenario} take the scenario under test.
MATRIX: list[tuple[str, str, str | None]] = [
    ("POST", "/v1/chat/completions", "serve"),
    ("POST", "/scenarios/{scenario}/v1/chat/completions", "serve"),
    ("POST", "/v1/messages", "serve"),
    ("POST", "/scenarios/{scenario}/v1/messages", "serve"),
    ("POST", "/v1/messages/count_tokens", "serve"),
    ("POST", "/scenarios/{scenario}/v1/messages/count_tokens", "serve"),
    ("POST", "/v1/responses", "serve"),
    ("POST", "/scenarios/{scenario}/v1/responses", "serve"),
    ("GET", "/v1/responses", "serve"),
    ("GET", "/scenarios/{scenario}/v1/responses", "serve"),
    ("GET", "/v1/responses/{response_id}", "serve"),
    ("GET", "/scenarios/{scenario}/v1/responses/{response_id}", "serve"),
    ("GET", "/v1/models", "serve"),
    ("POST", "/reef/scenarios/{name}/attempts/next", "serve"),
    ("GET", "/reef/harness", "serve"),
    ("GET", "/reef/harness/releases", "serve"),
    ("GET", "/reef/harness/install", "serve"),
    ("POST", "/reef/report", "report"),
    ("GET", "/reef/records/{receipt}", "read"),
    ("GET", "/reef/scenarios/{name}/records", "read"),
    ("GET", "/reef/status", "read"),
    ("GET", "/reef/scenarios/{name}/users", "read"),
    ("DELETE", "/reef/scenarios/{name}/users/{user}", "admin"),
    ("PATCH", "/reef/scenarios/{name}/users/{user}", "report"),
    ("GET", "/reef/scenarios/{name}/releases", "read"),
    ("GET", "/reef/releases/{release}", "read"),
    ("GET", "/reef/releases/{release}/lineage", "read"),
    ("GET", "/reef/diff", "read"),
    ("GET", "/reef/scenarios/{name}/archive", "read"),
    ("GET", "/reef/jobs", "read"),
    ("GET", "/reef/jobs/{job}", "read"),
    ("GET", "/metrics", "read"),
    ("GET", "/reef/scenarios/{name}/export", "read"),
    ("POST", "/reef/scenarios/{name}/releases", "admin"),
    ("POST", "/reef/scenarios/{name}/rollback", "admin"),
    ("POST", "/reef/scenarios/{name}/promote", "admin"),
    ("POST", "/reef/scenarios/{name}/train", "admin"),
    ("POST", "/reef/jobs/{job}/cancel", "admin"),
    ("GET", "/openapi.json", "any"),  # any valid token
    # the Tinker API (reefd/api/tinker_routes.py)
    ("POST", "/api/v1/client/config", "train"),
    ("POST", "/api/v1/client/dynamic_config", "train"),
    ("POST", "/api/v1/create_session", "train"),
    ("POST", "/api/v1/session_heartbeat", "train"),
    ("POST", "/api/v1/sessions/{session_id}/finish", "train"),
    ("POST", "/api/v1/telemetry", "train"),
    ("GET", "/api/v1/get_server_capabilities", "train"),
    ("POST", "/api/v1/create_model", "train"),
    ("POST", "/api/v1/get_info", "train"),
    ("POST", "/api/v1/forward_backward", "train"),
    ("POST", "/api/v1/optim_step", "train"),
    ("POST", "/api/v1/save_weights", "train"),
    ("POST", "/api/v1/save_weights_for_sampler", "train"),
    ("POST", "/api/v1/load_weights", "train"),
    ("POST", "/api/v1/retrieve_future", "train"),
    ("POST", "/api/v1/create_sampling_session", "train"),
    ("GET", "/api/v1/samplers/{sampler_id}", "train"),
    ("POST", "/api/v1/asample", "train"),
    ("GET", "/api/v1/healthz", "any"),
    ("GET", "/", None),
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
]
HEADER_SCENARIO = {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                   "/v1/responses/{response_id}", "/reef/report"}


def allows(scope_held: str, needed: str | None) -> bool:
    return needed in (None, "any", scope_held) or (scope_held == "admin" and needed == "read")


def test_every_route_of_the_app_is_in_the_matrix() -> None:
    """A route added without a line here fails: its scope must be decided, and tested below."""
    from reefd.app import Settings, build_app

    app = build_app(Settings(state_dir=Path(tempfile.mkdtemp()), tokens=["t" * 16]))
    served = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    assert served == {(m, p) for m, p, _ in MATRIX}


@dataclass
class World:
    daemon: Daemon
    tokens: dict[str, str]  # name -> token: "<scope>" (every scenario) and "<scope>-a" (scenario a only)
    ids: dict[str, dict[str, str]] = field(default_factory=dict)  # scenario -> receipt, response_id, release


def reefctl(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REEF_STATE": str(state)}
    env.pop("REEF_TOKENS_FILE", None)
    return subprocess.run([sys.executable, "-m", "reefd.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def call(d: Daemon, method: str, path: str, token: str | None, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    sent = {"content-type": "application/json", **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(d.url + path, data=data, headers=sent, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def upstream_yaml(url: str) -> str:
    return (f"defaults:\n  - model: upstream\n  - _self_\nmodel:\n  url: {url}\n  api_key_env: UP_KEY\n"
            "  upstream_model: up-model\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("tokens")
    with aiohttp_in_thread(build()) as up:
        yaml = upstream_yaml(up + "/v1")
        d = Daemon(scenarios=make_scenarios(base / "s", names=(), extra={"a": yaml, "b": yaml}),
                   state=base / "state", log_path=base / "reefd.log", env={"UP_KEY": "up-key"})
        tokens = {}
        for scope in SCOPES:
            for name, limit in ((scope, []), (f"{scope}-a", ["--scenario", "a"])):
                done = reefctl(d.state, "token", "create", name, "--scope", scope, *limit)
                assert done.returncode == 0, done.stderr
                tokens[name] = done.stdout.strip()
        d.start()
        try:
            yield seeded(World(d, tokens))
        finally:
            d.stop()


def seeded(w: World) -> World:
    """A receipt, a stored response and the base release of each scenario, made with the root token."""
    d = w.daemon
    for s in ("a", "b"):
        status, _ = call(d, "POST", "/v1/chat/completions", TOKEN, {"model": s, "messages": [
            {"role": "user", "content": "hi"}]}, {"x-reef-scenario": s})
        assert status == 200
        status, resp = call(d, "POST", "/v1/responses", TOKEN, {"model": s, "input": "hi"},
                            {"x-reef-scenario": s})
        assert status == 200, resp
        status, listed = call(d, "GET", f"/reef/scenarios/{s}/records", TOKEN)
        status, chain = call(d, "GET", f"/reef/scenarios/{s}/releases", TOKEN)
        assert status == 200 and chain["data"], chain
        w.ids[s] = {"receipt": listed["data"][0]["id"], "response_id": resp["id"],
                    "release": chain["data"][0]["id"]}
    return w


def request_for(method: str, path: str, scenario: str, ids: dict[str, str]) -> tuple[str, Any, dict[str, str]]:
    """A concrete request on `path` about `scenario`: (url path, JSON body or None, headers)."""
    url = path.format(scenario=scenario, name=scenario, job="job_missing", user="nobody", session_id="sess-none",
                      sampler_id="sess-none:sample:0",
                      **ids)
    headers = {"x-reef-scenario": scenario} if path in HEADER_SCENARIO else {}
    query: dict[str, str] = {}
    if path.startswith("/reef/harness"):
        query = {"scenario": scenario, "adapter": "claude"}
    if path == "/reef/diff":
        query = {"a": ids["release"], "b": ids["release"]}
    if path.endswith("/messages") or path.endswith("/count_tokens"):
        headers["anthropic-version"] = "2023-06-01"
    body: Any = None
    if method == "POST":
        body = {"model": scenario, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        if path.endswith("/responses"):
            body = {"model": scenario, "input": "hi", "max_output_tokens": 16}
        elif path == "/reef/report":
            body = {"references": [ids["receipt"]], "score": 1}
        elif path.startswith("/reef/"):
            body = {}
    return url + ("?" + urllib.parse.urlencode(query) if query else ""), body, headers


def refused(status: int, body: Any) -> bool:
    """A 403 in the documented shape (OpenAI's, or Anthropic's on /v1/messages)."""
    if status != 403:
        return False
    err = body["error"]
    assert err["type"] == "permission_error", body
    assert body.get("type") == "error" or err["code"] == "permission_denied", body
    return True


def test_each_scope_opens_its_routes_and_no_others(world: World) -> None:
    d, ids = world.daemon, world.ids["a"]
    matrix: dict[str, list[str]] = {}
    for method, path, needed in MATRIX:
        url, body, headers = request_for(method, path, "a", ids)
        row = []
        for scope in SCOPES:
            status, answer = call(d, method, url, world.tokens[scope], body, headers)
            assert status != 401, (method, url, answer)
            assert refused(status, answer) is not allows(scope, needed), (scope, method, url, status, answer)
            row.append("✓" if status != 403 else "403")
        status, answer = call(d, method, url, None, body, headers)
        assert (status == 401) is (needed is not None), (method, url, status)
        matrix[f"{method} {path}"] = row
    print(json.dumps({"scopes": SCOPES, "matrix": matrix}))


def test_a_token_limited_to_one_scenario_never_reaches_another(world: World) -> None:
    d = world.daemon
    for method, path, needed in MATRIX:
        if needed in (None, "any") or path.startswith("/api/v1/"):  # the Tinker API names its scenario only in
            continue  # create_model's base_model: tests/e2e/test_tinker.py tries a token limited to another one
        token = world.tokens[f"{needed}-a"]
        mine = request_for(method, path, "a", world.ids["a"])
        status, answer = call(d, method, *mine[:1], token, *mine[1:])
        if path == "/metrics":  # it spans every scenario: only an unlimited read token
            assert refused(status, answer)
            continue
        assert status not in (401, 403), (method, path, status, answer)
        theirs = request_for(method, path, "b", world.ids["b"])
        status, answer = call(d, method, theirs[0], token, *theirs[1:])
        by_id = any(k in path for k in ("{receipt}", "{release}", "{job}", "{response_id}")) or path == "/reef/diff"
        if method == "GET" and path.endswith("/v1/responses"):  # 405 or 426 for everyone: it reaches no scenario
            assert status in (405, 426), (path, status)
        elif by_id and "{scenario}" not in path and path not in HEADER_SCENARIO:
            assert status == 404, (method, path, status, answer)  # as if it did not exist
        elif path in ("/v1/models", "/reef/status", "/reef/jobs"):
            text = json.dumps(answer)
            assert status == 200 and '"b"' not in text, (path, answer)  # lists show only scenario a
        else:
            assert refused(status, answer), (method, path, status, answer)
    # scenario b's stored response, asked for as scenario a's: not found
    status, answer = call(d, "GET", f"/v1/responses/{world.ids['b']['response_id']}", world.tokens["serve-a"],
                          headers={"x-reef-scenario": "a"})
    assert status == 404, answer
    # a report on scenario a naming a receipt of scenario b stores nothing
    status, answer = call(d, "POST", "/reef/report", world.tokens["report-a"],
                          {"references": [world.ids["b"]["receipt"]], "score": 1}, {"x-reef-scenario": "a"})
    assert status == 404 and answer["error"]["code"] == "receipt_not_found", answer
    _, ready = call(d, "GET", "/readyz", world.tokens["read-a"])
    assert list(ready["scenarios"]) == ["a"]


def test_report_ids_are_per_scenario(world: World) -> None:
    d = world.daemon
    for s, score in (("a", 1), ("b", 0)):
        status, answer = call(d, "POST", "/reef/report", world.tokens["report"],
                              {"references": [world.ids[s]["receipt"]], "score": score, "report_id": "shared-1"},
                              {"x-reef-scenario": s})
        assert status == 200 and answer["scenario"] == s, answer
    status, answer = call(d, "POST", "/reef/report", world.tokens["report"],
                          {"references": [world.ids["a"]["receipt"]], "score": 0, "report_id": "shared-1"},
                          {"x-reef-scenario": "a"})
    assert status == 409 and answer["error"]["code"] == "report_conflict", answer


def test_the_file_keeps_hashes_and_sighup_applies_create_revoke_and_refuses_a_bad_file(tmp_path: Path) -> None:
    with aiohttp_in_thread(build()) as up:
        d = Daemon(scenarios=make_scenarios(tmp_path / "s", names=(), extra={"a": upstream_yaml(up + "/v1")}),
                   state=tmp_path / "state", log_path=tmp_path / "reefd.log", env={"UP_KEY": "up-key"})
        old = reefctl(d.state, "token", "create", "old", "--scope", "read").stdout.strip()
        d.start()
        try:
            text = (d.state / "tokens.json").read_text()
            assert old not in text and old.startswith("reef_")
            assert json.loads(text)["tokens"][0]["scopes"] == ["read"]
            assert (d.state / "tokens.json").stat().st_mode & 0o077 == 0
            assert call(d, "GET", "/reef/status", old)[0] == 200

            assert reefctl(d.state, "token", "revoke", "old").returncode == 0
            new = reefctl(d.state, "token", "create", "new", "--scope", "read").stdout.strip()
            assert call(d, "GET", "/reef/status", old)[0] == 200  # the file changes nothing until the reload
            assert call(d, "GET", "/reef/status", new)[0] == 401
            reload(d)
            assert call(d, "GET", "/reef/status", old)[0] == 401
            assert call(d, "GET", "/reef/status", new)[0] == 200
            listed = reefctl(d.state, "token", "list").stdout
            assert "new" in listed and "old" not in listed and new not in listed

            (d.state / "tokens.json").write_text("{not json")
            reload(d, expect="tokens file refused")
            assert call(d, "GET", "/reef/status", new)[0] == 200  # the previous tokens stay in force
            assert call(d, "GET", "/reef/status", TOKEN)[0] == 200
        finally:
            d.stop()
        started = subprocess.run([sys.executable, "-m", "reefd", "--scenarios", str(d.scenarios), "--state",
                                  str(d.state), "--listen", "127.0.0.1:0"], capture_output=True, text=True,
                                 timeout=60, env={**os.environ, "REEF_TOKEN": TOKEN})
        assert started.returncode == 2
        assert started.stderr.strip().count("\n") == 0 and "tokens.json: not JSON" in started.stderr


def reload(d: Daemon, expect: str = "reloaded the tokens file") -> None:
    seen = d.log_path.read_text(errors="replace").count(expect)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while d.log_path.read_text(errors="replace").count(expect) <= seen:
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.05)


def test_reefctl_with_a_scoped_token_sees_its_scenarios_and_says_what_to_pass(world: World) -> None:
    d = world.daemon

    def ctl(token: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "REEF_URL": d.url, "REEF_TOKEN": token}
        return subprocess.run([sys.executable, "-m", "reefd.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    status = ctl(world.tokens["read-a"], "status")
    assert status.returncode == 0, status.stderr
    rows = [line.split()[0] for line in status.stdout.splitlines()[1:] if not line.startswith("scenario ")]
    assert rows == ["a"] and " b:" not in status.stdout, status.stdout  # reason lines follow the table
    receipt = world.ids["a"]["receipt"]
    looked_up = ctl(world.tokens["report-a"], "report", receipt, "--score", "1")
    assert looked_up.returncode == 1 and "lacks the 'read' scope" in looked_up.stderr
    assert "pass --scenario NAME" in looked_up.stderr
    named = ctl(world.tokens["report-a"], "report", receipt, "--score", "1", "--scenario", "a")
    assert named.returncode == 0 and named.stdout.endswith(" created\n"), named.stderr
    denied = ctl(world.tokens["admin-a"], "train", "b")
    assert denied.returncode == 1 and "may not use scenario 'b'" in denied.stderr
