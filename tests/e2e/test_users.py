"""Who a user is, against a running reefd: user tokens and x-reef-user, names, users.max, what a user's token
reads, and sessions and Responses that belong to whoever opened them.

Contract test for the serving part: the scenarios pass through to tests/fake_upstream.py (who is served and who
may read what needs no model). Tokens are made with the real `reefctl token` command.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import TOKEN, Daemon, make_scenarios
from tests.e2e.test_tokens import call, reefctl, upstream_yaml
from tests.fake_upstream import build
from tests.served import aiohttp_in_thread

pytestmark = pytest.mark.contract

TOKENS = {"alice": ("--user", "alice", "--scenario", "u"), "bob": ("--user", "bob", "--scenario", "u"),
          "dave": ("--user", "dave"), "dave-u": ("--user", "dave", "--scenario", "u"),
          "t1": ("--scenario", "plain"), "t2": ("--scenario", "plain")}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, str]]]:
    base = tmp_path_factory.mktemp("users")
    with aiohttp_in_thread(build()) as up:
        yaml = upstream_yaml(up + "/v1")
        d = Daemon(scenarios=make_scenarios(base / "s", names=(), extra={
            "u": yaml + "users:\n  max: 3\n", "plain": yaml}), state=base / "state", log_path=base / "reefd.log",
            env={"UP_KEY": "up-key"})
        tokens = {}
        for name, args in TOKENS.items():
            done = reefctl(d.state, "token", "create", name, "--scope", "serve,report,read", *args)
            assert done.returncode == 0, done.stderr
            tokens[name] = done.stdout.strip()
        d.start()
        try:
            yield d, tokens
        finally:
            d.stop()


def chat(d: Daemon, token: str, text: str | list[dict[str, Any]], scenario: str = "u",
         **headers: str) -> tuple[int, Any, dict[str, Any] | None]:
    """A chat turn: its status, its answer, and its record (read with the root token) when it was served."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    status, answer = call(d, "POST", "/v1/chat/completions", token, {"model": scenario, "messages": messages},
                          {"x-reef-scenario": scenario, **{k.replace("_", "-"): v for k, v in headers.items()}})
    if status != 200:
        return status, answer, None
    _, listed = call(d, "GET", f"/reef/scenarios/{scenario}/records?limit=1000", TOKEN)
    return status, answer, next(r for r in listed["data"] if r["response"]["id"] == answer["id"])


def test_a_users_token_makes_that_users_turns_and_never_another_users(world: tuple[Daemon, dict[str, str]]
                                                                      ) -> None:
    d, tokens = world
    status, _, record = chat(d, tokens["alice"], "hi from alice")
    assert status == 200 and record is not None and record["user"] == "alice", record
    status, _, record = chat(d, tokens["alice"], "hi again", x_reef_user="alice")  # naming itself is fine
    assert status == 200 and record is not None and record["user"] == "alice"
    status, answer, _ = chat(d, tokens["alice"], "as bob", x_reef_user="bob")
    assert status == 403 and answer["error"]["code"] == "permission_denied", answer
    assert "speaks for its own user only" in answer["error"]["message"]
    status, _, record = chat(d, TOKEN, "for carol", x_reef_user="carol")  # a root token names the user
    assert status == 200 and record is not None and record["user"] == "carol"
    status, _, record = chat(d, TOKEN, "for nobody")
    assert status == 200 and record is not None and "user" not in record


@pytest.mark.parametrize("name", ["a/b", "..", "x..y", "-lead", "ends.", "x.lock", "", "é", "a b", "u" * 129])
def test_a_bad_user_name_is_a_400_that_says_why(world: tuple[Daemon, dict[str, str]], name: str) -> None:
    d, _ = world
    status, answer, _ = chat(d, TOKEN, "hi", x_reef_user=name)
    assert status == 400 and answer["error"]["code"] == "invalid_user", answer
    assert answer["error"]["param"] == "x-reef-user" and "the user name" in answer["error"]["message"]


def test_a_scenario_without_users_names_no_user(world: tuple[Daemon, dict[str, str]]) -> None:
    d, tokens = world
    for token, headers in ((TOKEN, {"x_reef_user": "carol"}), (tokens["dave"], {})):
        status, answer, _ = chat(d, token, "hi", "plain", **headers)
        assert status == 400 and answer["error"]["code"] == "users_off", answer
        assert "no users: block" in answer["error"]["message"]


def test_users_max_refuses_one_more_user_and_says_why(world: tuple[Daemon, dict[str, str]]) -> None:
    d, tokens = world
    for user in ("alice", "bob", "carol"):  # three users: users.max
        assert chat(d, TOKEN, "hi", x_reef_user=user)[0] == 200
    status, answer, _ = chat(d, TOKEN, "hi", x_reef_user="erin")
    assert status == 403 and answer["error"]["code"] == "user_limit_reached", answer
    assert "3 users (users.max)" in answer["error"]["message"]
    assert chat(d, tokens["bob"], "still served")[0] == 200  # a known user still is
    kept = json.loads((d.state / "users" / "u.json").read_text())["users"]
    assert sorted(kept) == ["alice", "bob", "carol"]
    status = next(s for s in call(d, "GET", "/reef/status", TOKEN)[1]["scenarios"] if s["name"] == "u")
    assert status["users"] == {"known": 3, "max": 3, "own_lines": 0}, status  # counts; no user's name
    _, metrics = call(d, "GET", "/metrics", TOKEN)
    assert isinstance(metrics, str) and "alice" not in metrics and 'user="' not in metrics  # no user label


def test_a_users_token_reads_and_reports_on_that_users_records_only(world: tuple[Daemon, dict[str, str]]) -> None:
    d, tokens = world
    _, _, mine = chat(d, tokens["alice"], "alice's own")
    _, _, theirs = chat(d, tokens["bob"], "bob's own")
    assert mine is not None and theirs is not None
    status, listed = call(d, "GET", "/reef/scenarios/u/records?limit=1000", tokens["alice"])
    assert status == 200 and listed["data"] and {r["user"] for r in listed["data"]} == {"alice"}
    assert call(d, "GET", f"/reef/records/{mine['id']}", tokens["alice"])[0] == 200
    status, answer = call(d, "GET", f"/reef/records/{theirs['id']}", tokens["alice"])
    assert status == 404 and answer["error"]["code"] == "record_not_found", answer
    status, answer = call(d, "GET", "/reef/scenarios/u/records?user=bob", tokens["alice"])
    assert status == 403, answer
    status, listed = call(d, "GET", "/reef/scenarios/u/records?user=bob&limit=1000", TOKEN)  # root filters by user
    assert status == 200 and listed["data"] and {r["user"] for r in listed["data"]} == {"bob"}
    status, text = call(d, "GET", "/reef/scenarios/u/export?user=bob", TOKEN)
    exported = [json.loads(line) for line in text.splitlines()] if isinstance(text, str) else [text]
    assert status == 200 and exported and {r["user"] for r in exported} == {"bob"}
    status, answer = call(d, "POST", "/reef/report", tokens["alice"], {"references": [theirs["id"]], "score": 1},
                          {"x-reef-scenario": "u"})
    assert status == 404 and answer["error"]["code"] == "receipt_not_found", answer
    status, answer = call(d, "POST", "/reef/report", tokens["alice"], {"references": [mine["id"]], "score": 1},
                          {"x-reef-scenario": "u"})
    assert status == 200, answer


def test_a_session_belongs_to_whoever_opened_it(world: tuple[Daemon, dict[str, str]]) -> None:
    """Another user's (or another token's) call with the same session header, or resending the transcript,
    never joins the session: it opens its own, and the owner's turn gets no next state from it."""
    d, tokens = world
    for scenario, opener, other in (("u", tokens["alice"], tokens["bob"]), ("plain", tokens["t1"], tokens["t2"])):
        session = {"x_reef_session": f"shared-name-{scenario}"}
        _, answer, first = chat(d, opener, "my secret plan", scenario, **session)
        assert first is not None and first["turn"] == 0
        _, _, joined = chat(d, other, "and then?", scenario, **session)
        assert joined is not None and joined["turn"] == 0 and joined["previous"] is None, joined
        transcript = [{"role": "user", "content": "my secret plan"},
                      {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "go on"}]
        _, _, resent = chat(d, other, transcript, scenario)
        assert resent is not None and resent["previous"] is None and resent["turn"] == 0, resent
        _, _, own = chat(d, opener, "go on", scenario, **session)
        assert own is not None and own["turn"] == 1 and own["previous"] == first["id"], own
        assert own["session"] == joined["session"]  # the same name, two sessions


def test_another_owners_response_is_one_that_does_not_exist(world: tuple[Daemon, dict[str, str]]) -> None:
    d, tokens = world
    for scenario, opener, other in (("u", tokens["alice"], tokens["bob"]), ("plain", tokens["t1"], tokens["t2"])):
        where = {"x-reef-scenario": scenario}
        status, resp = call(d, "POST", "/v1/responses", opener, {"model": scenario, "input": "hi"}, where)
        assert status == 200, resp
        assert call(d, "GET", f"/v1/responses/{resp['id']}", opener, headers=where)[0] == 200
        status, answer = call(d, "GET", f"/v1/responses/{resp['id']}", other, headers=where)
        assert status == 404 and answer["error"]["code"] == "response_not_found", answer
        for headers in (where, {}):  # naming the scenario, and leaving it to the response it continues
            missing = call(d, "POST", "/v1/responses", other, {"model": scenario, "input": "more",
                                                               "previous_response_id": "resp_01NOSUCHRESPONSE"},
                           headers)
            status, answer = call(d, "POST", "/v1/responses", other, {"model": scenario, "input": "more",
                                                                      "previous_response_id": resp["id"]}, headers)
            assert status == 400 and answer["error"] == missing[1]["error"] | {"message": answer["error"]["message"]}
            assert answer["error"]["message"] == missing[1]["error"]["message"].replace("resp_01NOSUCHRESPONSE",
                                                                                        resp["id"]), answer
        status, answer = call(d, "POST", "/v1/responses", opener, {"model": scenario, "input": "more",
                                                                   "previous_response_id": resp["id"]})
        assert status == 200, answer


def test_reefctl_token_create_takes_a_user_and_lists_it(world: tuple[Daemon, dict[str, str]]) -> None:
    d, _ = world
    listed = reefctl(d.state, "token", "list")
    assert listed.returncode == 0
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert rows["alice"][4] == "alice" and rows["t1"][4] == "*", listed.stdout
    bad = reefctl(d.state, "token", "create", "mallory", "--scope", "serve", "--user", "../root")
    assert bad.returncode != 0 and "--user: '../root' holds '/'" in bad.stderr, bad.stderr


def test_a_user_consents_to_sharing_for_themselves_only(world: tuple[Daemon, dict[str, str]]) -> None:
    """PATCH …/users/NAME {"share": bool}: a user's token sets its own user's consent, never another's; the list
    shows it; a bad body is 400 and a user nobody knows 404."""
    d, tokens = world
    assert chat(d, tokens["alice"], "hello from alice")[0] == 200  # alice is one of u's users now
    status, kept = call(d, "PATCH", "/reef/scenarios/u/users/alice", tokens["alice"], {"share": True})
    assert status == 200 and kept == {"object": "reef.user", "scenario": "u", "user": "alice", "share": True,
                                      "promotions": False}, kept  # u has no users.share: nothing is promoted
    status, err = call(d, "PATCH", "/reef/scenarios/u/users/alice", tokens["bob"], {"share": False})
    assert status == 403 and err["error"]["code"] == "permission_denied", err
    _, listed = call(d, "GET", "/reef/scenarios/u/users", TOKEN)
    assert {r["user"]: r["share"] for r in listed["data"]}["alice"] is True
    status, err = call(d, "PATCH", "/reef/scenarios/u/users/alice", TOKEN, {"share": "yes"})
    assert status == 400 and err["error"]["param"] == "share", err
    status, err = call(d, "PATCH", "/reef/scenarios/u/users/nobody-here", TOKEN, {"share": True})
    assert status == 404 and err["error"]["code"] == "user_not_found", err
    assert call(d, "PATCH", "/reef/scenarios/u/users/alice", tokens["alice"], {"share": False})[1]["share"] is False


def test_deleting_a_user_revokes_their_tokens_for_that_scenario_alone(world: tuple[Daemon, dict[str, str]]) -> None:
    """dave's token limited to u stops being accepted once dave is deleted from u; his token that reaches every
    scenario is kept (dave exists elsewhere) and named in the answer."""
    d, tokens = world
    for user in [r["user"] for r in call(d, "GET", "/reef/scenarios/u/users", TOKEN)[1]["data"]]:
        assert call(d, "DELETE", f"/reef/scenarios/u/users/{user}", TOKEN)[0] == 200  # room under users.max
    assert chat(d, tokens["dave-u"], "dave here")[0] == 200
    status, gone = call(d, "DELETE", "/reef/scenarios/u/users/dave", TOKEN)
    assert status == 200 and (gone["tokens_revoked"], gone["tokens_kept"]) == (["dave-u"], ["dave"]), gone
    status, err, _ = chat(d, tokens["dave-u"], "still here?")
    assert status == 401 and err["error"]["code"] == "invalid_api_key", err
    assert "dave-u" not in reefctl(d.state, "token", "list").stdout
    assert chat(d, tokens["dave"], "dave, anew")[0] == 200  # the token for every scenario still speaks for him
