"""Conversations: which session and turn each request is, the next state of the turn it continues, retries,
side calls and expiry (reefd/observe/conversations.py), without a daemon. The daemon's use of it is in
tests/e2e/test_openclaw.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from reefd.observe.conversations import Conversations, Placement, chain, fingerprint, identity

SYSTEM = {"role": "system", "content": "You are helpful."}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def serve(c: Conversations, receipt: str, messages: list[dict[str, Any]], reply: str, header: str | None = None,
          tools: list[dict[str, Any]] | None = None, **kw: Any) -> Placement:
    """Place a request, then mark it served with `reply` (what the daemon does once the record is durable)."""
    p = c.place("s", receipt, header, messages, tools or [], **kw)
    c.served("s", receipt, p, chain(p.request, {"role": "assistant", "content": reply}))
    return p


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_a_resent_transcript_continues_its_session_and_links_the_next_state() -> None:
    c = Conversations(lambda _: 900.0, Clock())
    first = serve(c, "r0", [SYSTEM, user("hi")], "Hello!")
    assert (first.session, first.turn, first.kind, first.previous) == ("s-r0", 0, "main", None)
    # the client resends everything: the reply sits in the next slot, then one more message
    second = serve(c, "r1", [SYSTEM, user("hi"), said("Hello!"), user("Please start with OK:")], "OK: sure")
    assert (second.session, second.turn, second.previous) == ("s-r0", 1, "r0")
    assert second.next_state == [{"role": "user", "content": "Please start with OK:"}]
    # a tool result is a next state too, with its role
    third = serve(c, "r2", [SYSTEM, user("hi"), said("Hello!"), user("Please start with OK:"),
                            {"role": "assistant", "content": "OK: sure"}, user("run it"),
                            ], "calling")
    assert (third.turn, third.previous) == (2, "r1")
    fourth = c.place("s", "r3", None, [SYSTEM, user("hi"), said("Hello!"), user("Please start with OK:"),
                                        said("OK: sure"), user("run it"), said("calling"),
                                        {"role": "tool", "content": "exit 0", "tool_call_id": "c1"}], [])
    assert (fourth.turn, fourth.previous) == (3, "r2")
    assert fourth.next_state == [{"role": "tool", "content": "exit 0"}]
    assert c.counts("s")["unlinked"] == 0


def test_only_a_strict_extension_continues() -> None:
    c = Conversations(lambda _: 900.0, Clock())
    serve(c, "r0", [user("hi")], "Hello!")
    # request + reply but nothing after it: not a continuation (nothing to judge the reply by)
    same = c.place("s", "r1", None, [user("hi"), said("Hello!")], [])
    assert same.previous is None and same.unlinked
    # another reply in the slot (the client edited it): no match, a new session that is counted as unlinked
    edited = c.place("s", "r2", None, [user("hi"), said("Hello there"), user("more")], [])
    assert edited.previous is None and edited.session == "s-r2" and edited.unlinked
    assert c.counts("s")["unlinked"] == 2
    # whitespace around the text and the key order of tool arguments do not change a message's identity
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1, "b": 2}'}}]}
    p = c.place("s", "r3", None, [user("list")], [])
    c.served("s", "r3", p, chain(p.request, call))
    resent = {"role": "assistant", "content": "",
              "tool_calls": [{"id": "z", "type": "function", "function": {"name": "ls", "arguments": '{"b":2,"a":1}'}}]}
    nxt = c.place("s", "r4", None, [user("list "), resent, {"role": "tool", "content": "x"}], [])
    assert nxt.previous == "r3"


def test_an_identical_resend_is_a_retry_and_the_first_receipt_keeps_the_slot() -> None:
    c = Conversations(lambda _: 900.0, Clock())
    serve(c, "r0", [user("hi")], "Hello!", header="S")
    serve(c, "r1", [user("hi"), said("Hello!"), user("again")], "One", header="S")
    retry = serve(c, "r2", [user("hi"), said("Hello!"), user("again")], "Two", header="S")
    assert (retry.kind, retry.turn, retry.retry_of, retry.previous) == ("retry", 1, "r1", None)
    # the continuation extends the first reply: it links to the first receipt
    nxt = c.place("s", "r3", "S", [user("hi"), said("Hello!"), user("again"), said("One"), user("ok")], [])
    assert (nxt.turn, nxt.previous) == (2, "r1")
    # had the client kept the retry's answer, the continuation would link to the retry (the reply it extends)
    other = c.place("s", "r4", "S", [user("hi"), said("Hello!"), user("again"), said("Two"), user("ok")], [])
    assert (other.turn, other.previous) == (2, "r2")
    headerless = Conversations(lambda _: 900.0, Clock())
    serve(headerless, "q0", [user("hi")], "Hello!")
    again = headerless.place("s", "q1", None, [user("hi")], [])
    assert (again.kind, again.retry_of, again.session) == ("retry", "q0", "s-q0")
    assert headerless.counts("s")["retries"] == 1


def test_a_header_session_continues_in_arrival_order_and_side_calls_stay_out() -> None:
    c = Conversations(lambda _: 900.0, Clock())
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    serve(c, "r0", [SYSTEM, user("fix the bug")], "Looking", header="S", tools=tools)
    # a title request with the same session header: another system prompt, no tools → side
    title = serve(c, "r1", [{"role": "system", "content": "Write a title"}, user("fix the bug")], "Bug fix",
                  header="S")
    assert (title.kind, title.turn, title.session) == ("side", None, "S")
    # the client marks a call as side itself
    marked = serve(c, "r2", [SYSTEM, user("summarize")], "...", header="S", tools=tools, side=True)
    assert marked.kind == "side"
    # a client that sends only the new message (no transcript) still continues its header's session
    nxt = serve(c, "r3", [SYSTEM, user("it still fails")], "Sorry", header="S", tools=tools)
    assert (nxt.turn, nxt.previous, nxt.next_state) == (1, "r0", [{"role": "user", "content": "it still fails"}])
    assert c.counts("s")["side"] == 2


def test_sessions_expire_after_their_ttl_and_are_counted() -> None:
    clock = Clock()
    c = Conversations(lambda _: 60.0, clock)
    serve(c, "r0", [user("hi")], "Hello!")
    serve(c, "r1", [user("yo")], "Hey", header="H")
    assert c.counts("s")["open"] == 2
    clock.now += 61
    late = c.place("s", "r2", None, [user("hi"), said("Hello!"), user("more")], [])
    assert late.previous is None and late.unlinked  # the session it would continue has expired
    counts = c.counts("s")
    assert counts["expired"] == 2 and counts["open"] == 0 and counts["unlinked"] == 1
    header = c.place("s", "r3", "H", [user("back")], [])
    assert (header.turn, header.previous) == (0, None)


def test_open_turns_are_reopened_from_their_records() -> None:
    clock = Clock()
    c = Conversations(lambda _: 900.0, clock)
    p = c.place("s", "r0", None, [user("hi")], [])
    record = {"id": "r0", "created_at": clock.now, **p.fields()}
    record["conversation"]["reply"] = chain(p.request, said("Hello!"))
    fresh = Conversations(lambda _: 900.0, clock)  # a restarted daemon
    fresh.restore("s", record)
    nxt = fresh.place("s", "r1", None, [user("hi"), said("Hello!"), user("thanks")], [])
    assert (nxt.session, nxt.turn, nxt.previous) == ("s-r0", 1, "r0")
    fresh.restore("s", {"id": "bad", "turn_kind": "main", "conversation": {"request": "x"}})  # ignored, no error


def test_a_session_served_again_outlives_one_that_went_quiet() -> None:
    """Expiry follows each session's newest turn: a session opened first but served again stays open while one
    opened later and left quiet expires (expiry looks at the oldest turns only, not at every open session)."""
    clock = Clock()
    c = Conversations(lambda _: 60.0, clock)
    serve(c, "r0", [user("first")], "One", header="A")
    clock.now += 10
    serve(c, "r1", [user("second")], "Two", header="B")
    clock.now += 40
    serve(c, "r2", [user("first again")], "Three", header="A")
    clock.now += 15  # B was last seen 55 s ago, A's first turn 65 s ago but its newest 15 s ago
    assert c.counts("s") == {**c.counts("s"), "open": 2, "expired": 0}
    clock.now += 10  # B: 65 s
    assert (c.counts("s")["open"], c.counts("s")["expired"]) == (1, 1)
    nxt = c.place("s", "r3", "A", [user("first again"), said("Three"), user("and again")], [])
    assert (nxt.turn, nxt.previous) == (2, "r2")
    gone = c.place("s", "r4", "B", [user("second"), said("Two"), user("more")], [])
    assert (gone.turn, gone.previous, gone.unlinked) == (0, None, True)


TRICKY = ["", "plain", "é and 😀", 'a "quote" \\ slash /', "line\nbreak\ttab", "\x00\x1f\x7f", "\u2028", "\ud800 lone",
          "Zed", "zed"]


def test_the_hashes_records_keep_are_those_of_the_canonical_json() -> None:
    """Records keep a turn's hashes, and a restart reopens sessions from them: the written-out encodings on the
    hot path must give the same bytes as the JSON encoders they stand for, for any text."""
    canonical = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    for role in ("user", "assistant", *TRICKY):
        for text in TRICKY:
            message = {"role": role, "content": text}
            assert identity(message) == canonical.encode([role, text.strip(), []]).encode("utf-8", "surrogatepass")
    system = [{"role": "system", "content": t} for t in TRICKY[:4]]
    tools = [{"type": "function", "function": {"name": t}} for t in reversed(TRICKY)]
    for messages, named in (([*system, user("hi")], tools), ([user("hi")], []), (system[:1], tools[:1])):
        written = json.dumps([[t.strip() for t in (m["content"] for m in messages if m["role"] == "system")],
                              sorted(t["function"]["name"] for t in named)])
        assert fingerprint(messages, named) == hashlib.blake2b(written.encode(), digest_size=8).hexdigest()


def test_the_owner_of_a_call_that_names_no_scenario_is_the_scenario_of_its_session() -> None:
    """By the session header; else by a transcript extending a served turn (a bare repeat is no evidence); never
    a guess: no scenario, or two, is None; and an expired session no longer owns anything."""
    clock = Clock()
    c = Conversations(lambda _: 900.0, clock)
    for name in ("a", "b"):
        p = c.place(name, f"{name}0", None, [SYSTEM, user(f"hi {name}")], [])
        c.served(name, f"{name}0", p, chain(p.request, said("Hello!")))
    p = c.place("a", "a1", "sess-1", [user("start")], [])
    c.served("a", "a1", p, chain(p.request, said("ok")))
    assert c.scenario_of("sess-1", []) == "a" and c.scenario_of("sess-2", []) is None
    assert c.scenario_of(None, [SYSTEM, user("hi b"), said("Hello!"), user("more")]) == "b"  # extends b0
    assert c.scenario_of(None, [SYSTEM, user("hi a")]) is None  # a repeat of a0's request: anyone may open so
    assert c.scenario_of(None, [SYSTEM, user("hi c")]) is None
    p = c.place("b", "b1", "sess-1", [user("start")], [])  # the same session id in two scenarios
    c.served("b", "b1", p, chain(p.request, said("ok")))
    assert c.scenario_of("sess-1", []) is None
    clock.now += 901
    assert c.scenario_of(None, [SYSTEM, user("hi b"), said("Hello!"), user("more")]) is None


def test_a_session_is_its_owners_alone_by_header_by_transcript_and_after_a_restart() -> None:
    """Another owner's call with the same header, or extending the same transcript, opens a session of its own;
    the counts are the scenario's, over every owner; restored turns keep their owner (none: root's)."""
    c = Conversations(lambda _: 900.0, Clock())
    first = c.place("s", "r0", "S", [user("plan")], [], owner="t1/alice")
    c.served("s", "r0", first, chain(first.request, said("ok")), owner="t1/alice")
    joined = c.place("s", "r1", "S", [user("plan"), said("ok"), user("more")], [], owner="t1/bob")
    assert (joined.session, joined.turn, joined.previous) == ("S", 0, None)
    resent = c.place("s", "r2", None, [user("plan"), said("ok"), user("more")], [], owner="t2")
    assert resent.previous is None and resent.unlinked
    own = c.place("s", "r3", "S", [user("plan"), said("ok"), user("more")], [], owner="t1/alice")
    assert (own.turn, own.previous) == (1, "r0")
    assert c.scenario_of("S", [], "t1/alice") == "s" and c.scenario_of("S", [], "t1/bob") is None
    assert c.counts("s")["open"] == 1
    fresh = Conversations(lambda _: 900.0, Clock())
    record = {"id": "r0", "session": "S", "turn": 0, "turn_kind": "main", "created_at": 1000.0,
              "conversation": {"request": first.request, "reply": chain(first.request, said("ok")), "length": 1,
                               "fingerprint": first.fingerprint, "explicit": True}}
    fresh.restore("s", {**record, "owner": "t1/alice"})
    fresh.restore("s", {**record, "id": "old", "session": "O"})  # written before sessions had owners
    assert fresh.place("s", "q1", "S", [user("x")], [], owner="t1/alice").previous == "r0"
    assert fresh.place("s", "q2", "S", [user("x")], []).previous is None
    assert fresh.place("s", "q3", "O", [user("x")], []).previous == "old"  # root's
