"""Where tokens come from, how they are compared, and what a scoped token may do."""

from __future__ import annotations

import asyncio
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reefd.ops import tokens
from reefd.ops.auth import Keyring, load_tokens, matches
from reefd.ops.tokens import FULL


def test_env_tokens_allow_rotation(tmp_path: Path) -> None:
    assert load_tokens(tmp_path, {"REEF_TOKEN": "new, old"}) == ["new", "old"]
    assert not (tmp_path / "token").exists()


def test_systemd_credential_is_used(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "token").write_text("from-cred\n")
    assert load_tokens(tmp_path / "state", {"CREDENTIALS_DIRECTORY": str(creds)}) == ["from-cred"]


def test_generated_once_then_reused_mode_0600(tmp_path: Path) -> None:
    first = load_tokens(tmp_path, {})
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    assert load_tokens(tmp_path, {}) == first
    assert first[0].startswith("reef-") and len(first[0]) > 40


def test_matches_any_token_and_rejects_missing() -> None:
    assert matches("b", ["a", "b"])
    assert not matches("c", ["a", "b"])
    assert not matches(None, ["a"])
    assert not matches("", [""])


# ---------------------------------------------------------------- scoped tokens


def test_a_created_token_is_kept_as_its_hash_and_grants_its_scopes(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    token, entry = tokens.create(path, "ci", frozenset({"report"}), frozenset({"hello"}))
    assert token not in path.read_text() and entry.sha256 in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = Keyring(["root-token"], path)
    assert ring.reload() == 1
    grant = ring.grant(token)
    assert grant is not None and grant.name == "ci"
    assert grant.allows("report") and not grant.allows("serve") and not grant.allows("read")
    assert grant.covers("hello") and not grant.covers("other")
    assert ring.grant("root-token") is FULL and FULL.covers("any") and FULL.allows("admin")
    assert ring.grant(token + "x") is None and ring.grant(None) is None and ring.grant("") is None


def test_a_users_token_carries_its_user_and_a_name_that_cannot_be_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    token, entry = tokens.create(path, "alice", frozenset({"serve"}), None, "alice@example.com")
    assert entry.as_json()["user"] == "alice@example.com"
    ring = Keyring([], path)
    ring.reload()
    grant = ring.grant(token)
    assert grant is not None and grant.user == "alice@example.com" and "for user 'alice@example.com'" in \
        grant.describe()
    for bad, why in (("a/b", "holds '/'"), ("a..b", "holds '..'"), ("a\0b", "holds a NUL"), ("", "is empty"),
                     ("x" * 129, "longer than 128"), (".hidden", "starts with a letter or digit"),
                     ("refs.lock", "ends with"), ("tab\t", "may hold only")):
        assert why in (tokens.user_problem(bad) or ""), bad
        with pytest.raises(tokens.TokensFileError, match="--user"):
            tokens.create(path, "bad", frozenset({"serve"}), None, bad)
    assert tokens.user_problem("Bob_1+tag@example.org") is None
    path.write_text(path.read_text().replace("alice@example.com", "a/b"))
    with pytest.raises(tokens.TokensFileError, match=r"tokens\[0\] \(alice\): user 'a/b' holds '/'"):
        ring.reload()


def test_admin_implies_read_and_nothing_else() -> None:
    admin = tokens.Grant("ops", frozenset({"admin"}))
    assert admin.allows("admin") and admin.allows("read")
    assert not admin.allows("serve") and not admin.allows("report")


def test_revoke_removes_one_token_and_names_the_others_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    kept, _ = tokens.create(path, "a", frozenset({"serve"}), None)
    gone, _ = tokens.create(path, "b", frozenset({"serve"}), None)
    tokens.revoke(path, "b")
    ring = Keyring([], path)
    ring.reload()
    assert ring.grant(gone) is None and ring.grant(kept) is not None
    with pytest.raises(tokens.TokensFileError, match=r"no token named 'b'.*tokens: a"):
        tokens.revoke(path, "b")
    with pytest.raises(tokens.TokensFileError, match="already exists"):
        tokens.create(path, "a", frozenset({"read"}), None)


def test_concurrent_creates_lose_no_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda i: tokens.create(path, f"t{i}", frozenset({"read"}), None)[0], range(24)))
    ring = Keyring([], path)
    assert ring.reload() == 24 and all(ring.grant(t) is not None for t in made)


@pytest.mark.parametrize(("text", "problem"), [
    ("", "is empty"),  # what an interrupted write or `> tokens.json` leaves
    ("  \n", "is empty"),
    ("{not json", "not JSON"),
    ('{"tokens": {}}', 'must be an object {"tokens": [...]}'),
    ('{"tokens": [{"name": "x", "sha256": "abc", "scopes": ["read"]}]}', "64 lowercase hex digits"),
    ('{"tokens": [{"name": "x", "sha256": "' + "a" * 64 + '", "scopes": ["root"]}]}', "unknown scope 'root'"),
    ('{"tokens": [{"name": "x", "sha256": "' + "a" * 64 + '", "scopes": []}]}', "no scope given"),
    ('{"tokens": [{"name": "x y", "sha256": "' + "a" * 64 + '", "scopes": ["read"]}]}', "name must be"),
    ('{"tokens": [{"name": "x", "sha256": "' + "a" * 64 + '", "scopes": ["read"], "scenarios": []}]}',
     "non-empty list"),
    ('{"tokens": [{"name": "x", "sha256": "' + "a" * 64 + '", "scopes": ["read"]}, '
     '{"name": "x", "sha256": "' + "b" * 64 + '", "scopes": ["read"]}]}', "two tokens are named 'x'"),
])
def test_a_file_that_cannot_be_used_is_refused_with_its_problem_and_the_old_tokens_stay(
        tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "tokens.json"
    token, _ = tokens.create(path, "good", frozenset({"read"}), None)
    ring = Keyring([], path)
    ring.reload()
    path.write_text(text)
    with pytest.raises(tokens.TokensFileError, match=re.escape(problem)) as info:
        ring.reload()
    assert str(path) in str(info.value)
    assert ring.grant(token) is not None  # still in force


def test_no_file_means_no_scoped_tokens(tmp_path: Path) -> None:
    ring = Keyring(["r"], tmp_path / "absent.json")
    assert ring.reload() == 0 and ring.grant("r") is FULL


def test_a_deleted_file_revokes_every_scoped_token_and_one_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    token, _ = tokens.create(path, "good", frozenset({"read"}), None)
    ring = Keyring(["r"], path)
    assert ring.reload() == 1
    path.write_bytes(b"\xff\xfe not text")
    with pytest.raises(tokens.TokensFileError, match="cannot read it"):
        ring.reload()
    assert ring.grant(token) is not None
    path.unlink()
    assert ring.reload() == 0 and ring.grant(token) is None and ring.grant("r") is FULL


def test_a_job_of_another_scenario_is_not_found_for_a_limited_token(tmp_path: Path) -> None:
    """Jobs are reached by id: one of a scenario the token does not cover answers as if it did not exist."""
    from aiohttp.test_utils import TestClient, TestServer

    from reefd.app import Settings, build_app
    from reefd.grow.job_store import Job
    from reefd.loop import SCHEDULER

    path = tmp_path / "tokens.json"
    limited, _ = tokens.create(path, "ops-a", frozenset({"admin"}), frozenset({"a"}))
    app = build_app(Settings(state_dir=tmp_path / "state", tokens=["root-token-x"], tokens_file=path))

    async def body() -> None:
        async with TestClient(TestServer(app)) as client:
            jobs = app[SCHEDULER].jobs.jobs
            jobs["job_a"] = Job(id="job_a", scenario="a", reason="manual", recipe="sao", state="published")
            jobs["job_b"] = Job(id="job_b", scenario="b", reason="manual", recipe="sao", state="published")
            auth = {"Authorization": f"Bearer {limited}"}
            assert (await client.get("/reef/jobs/job_a", headers=auth)).status == 200
            for method, url in (("GET", "/reef/jobs/job_b"), ("POST", "/reef/jobs/job_b/cancel")):
                r = await client.request(method, url, headers=auth)
                assert r.status == 404 and (await r.json())["error"]["code"] == "job_not_found"
            listed = await (await client.get("/reef/jobs", headers=auth)).json()
            assert [j["id"] for j in listed["data"]] == ["job_a"]
            r = await client.get("/reef/jobs?scenario=b", headers=auth)
            assert r.status == 403 and (await r.json())["error"]["code"] == "permission_denied"
            root = await (await client.get("/reef/jobs", headers={"Authorization": "Bearer root-token-x"})).json()
            assert sorted(j["id"] for j in root["data"]) == ["job_a", "job_b"]

    asyncio.run(body())
