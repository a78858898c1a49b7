"""Conversations: which session and turn a request is, and the next state each served turn gets.

A session comes from a header (x-reef-session, or an agent's own session header). A client that resends the
whole transcript instead continues a session when its request strictly extends that session's last served
turn: the served reply sits in the next slot, followed by at least one more message. Message identity is role,
text, and tool name plus arguments. When turn n+1 arrives, turn n gets its next state: the messages that follow
its reply (a user's next message, or a tool's result), which a recipe may judge.

- main: a turn of the conversation. Its index counts from 0 within the session.
- retry: an identical resend of a served turn. It takes the same index; the first receipt keeps the slot, and a
  continuation links to whichever reply it actually extends.
- side: a call with the session's header that is not part of the conversation: another system prompt or tool
  set (a title request, a compaction, a sub-agent), or one the client marks with `x-reef-turn: side`. It never
  gets a next state, so it never trains.

A session belongs to whoever opened it (its owner: the token, and the user it speaks for). Another owner's call
never joins it, by header or by transcript: it is placed as if the session did not exist.

Open sessions live in memory, rebuilt at start from the records of the last `session_ttl_s`, and expire after
that long without a turn. Knows nothing of HTTP, LMDB or recipes: the caller stores what `place` decides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("reefd.observe.conversations")

SYSTEM_ROLES = ("system", "developer")


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts, stripped."""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(p for p in parts if p).strip()
    return ""


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as canonical JSON when they parse, else the text as sent."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw.strip()
    return raw


def identity(message: dict[str, Any]) -> bytes:
    """What makes two messages the same for continuation: role, text, and each tool call's name and arguments."""
    calls = [((c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments")))
             for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    role, text = message.get("role"), text_of(message.get("content"))
    if not calls and isinstance(role, str):  # most messages: the encoder's own bytes, without building one
        canonical = f"[{_string(role)},{_string(text)},[]]"
    else:
        canonical = _CANONICAL.encode([role, text, calls])
    return canonical.encode("utf-8", "surrogatepass")


_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))
_string = json.encoder.encode_basestring  # a JSON string as _CANONICAL writes it (ensure_ascii=False)
_ascii = json.encoder.encode_basestring_ascii  # ... and as json.dumps writes it


def fingerprint(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The conversation's frame: its leading system text and its tools' names. Side calls differ in it.
    The hash is of `json.dumps([system, names])`, written out here (it runs on every turn)."""
    system = ", ".join(_ascii(text_of(m.get("content"))) for m in _leading_system(messages))
    names = ", ".join(map(_ascii, sorted(str((t.get("function") or t).get("name")) for t in tools
                                          if isinstance(t, dict))))
    return hashlib.blake2b(f"[[{system}], [{names}]]".encode(), digest_size=8).hexdigest()


def _leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = 0
    while n < len(messages) and messages[n].get("role") in SYSTEM_ROLES:
        n += 1
    return messages[:n]


def chain(previous: str, message: dict[str, Any]) -> str:
    """The hash of a conversation prefix, extended by one message."""
    return hashlib.blake2b(previous.encode() + b"\x1f" + identity(message), digest_size=16).hexdigest()


def prefix_hashes(messages: Iterable[dict[str, Any]]) -> list[str]:
    """h[i] identifies the first i+1 messages of a conversation (see `conversation`)."""
    out: list[str] = []
    previous = ""
    for m in messages:
        previous = chain(previous, m)
        out.append(previous)
    return out


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages that take part in continuation (the leading system messages dropped)."""
    return messages[len(_leading_system(messages)):]


@dataclass
class Turn:
    """A served main (or retry) turn, open for a continuation."""

    receipt: str
    session: str
    index: int
    request: str  # hash of its request's conversation messages
    reply: str  # hash of those messages plus the served reply
    length: int  # conversation messages in its request
    fingerprint: str
    seen: float
    explicit: bool  # the session came from a header
    release: str | None = None  # the release that served it (a canary keeps the session on its side)


@dataclass
class Placement:
    """Where a request sits: what the record says of its session and turn, and the link it makes."""

    session: str | None
    turn: int | None
    kind: str  # main | retry | side
    previous: str | None = None  # the turn this one continues; it gets `next_state`
    next_state: list[dict[str, Any]] = field(default_factory=list)
    retry_of: str | None = None
    unlinked: bool = False  # mid-conversation (it holds an assistant message) but no open turn matched
    request: str = ""
    length: int = 0
    fingerprint: str = ""
    explicit: bool = False
    sticky: str | None = None  # the release that served the session's turn this one follows (or repeats)

    def fields(self) -> dict[str, Any]:
        """The record's fields for it (`conversation` is what reopens the turn after a restart; the reply's hash
        is added once the reply is known)."""
        out: dict[str, Any] = {"session": self.session, "turn": self.turn, "turn_kind": self.kind,
                               "previous": self.previous,
                               "conversation": {"request": self.request, "length": self.length,
                                                "fingerprint": self.fingerprint, "explicit": self.explicit}}
        if self.retry_of:
            out["retry_of"] = self.retry_of
        if self.unlinked:
            out["unlinked"] = True
        return out


@dataclass
class Counts:
    """Per scenario, since reefd started: what correlation did, so a failure to link is visible."""

    linked: int = 0
    unlinked: int = 0
    retries: int = 0
    side: int = 0
    expired: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Open:
    """One owner's open turns in one scenario. Each map is kept oldest first (by `seen`), so expiring is a look at
    its head, not a scan of every open session on every turn. `counts` are the scenario's, shared by its owners."""

    def __init__(self, counts: Counts) -> None:
        self.by_reply: OrderedDict[str, Turn] = OrderedDict()
        self.by_request: OrderedDict[str, Turn] = OrderedDict()  # a request's first main turn
        self.last: OrderedDict[str, Turn] = OrderedDict()  # session -> its newest main turn
        self.counts = counts
        self.oldest = math.inf  # no open turn was seen before this: a cutoff at or below it expires nothing

    def open(self, turn: Turn, kind: str) -> None:
        self.oldest = min(self.oldest, turn.seen)
        self.by_reply[turn.reply] = turn
        self.by_reply.move_to_end(turn.reply)
        if kind == "main":
            self.by_request.setdefault(turn.request, turn)
            current = self.last.get(turn.session)
            if current is None or current.index <= turn.index:
                self.last[turn.session] = turn
                self.last.move_to_end(turn.session)

    def expire(self, cutoff: float) -> int:
        """Forget the turns last seen before `cutoff`; returns how many sessions went."""
        if cutoff <= self.oldest:  # every turn's check on a scenario with nothing to expire
            return 0
        _drop_before(self.by_reply, cutoff)
        _drop_before(self.by_request, cutoff)
        gone = _drop_before(self.last, cutoff)
        self.oldest = min((next(iter(turns.values())).seen for turns in (self.by_reply, self.by_request, self.last)
                           if turns), default=math.inf)
        return gone


def _drop_before(turns: OrderedDict[str, Turn], cutoff: float) -> int:
    n = 0
    while turns and next(iter(turns.values())).seen < cutoff:
        turns.popitem(last=False)
        n += 1
    return n


def _decide(s: _Open, receipt: str, header: str | None, convo: list[dict[str, Any]], hashes: list[str],
            frame: str, side: bool) -> dict[str, Any]:
    """Placement's session, turn, kind and links for a request (see Conversations.place); counts what it found."""
    request = hashes[-1] if hashes else ""
    mid = any(m.get("role") == "assistant" for m in convo)
    if side:
        s.counts.side += 1
        known = s.last.get(header) if header is not None else None
        return {"session": header or f"s-{receipt}", "turn": None, "kind": "side",
                "sticky": known.release if known is not None else None}
    if header is not None:
        last = s.last.get(header)
        if last is None:
            s.counts.unlinked += mid
            return {"session": header, "turn": 0, "kind": "main", "unlinked": mid}
        if last.fingerprint != frame:
            s.counts.side += 1
            return {"session": header, "turn": None, "kind": "side", "sticky": last.release}
        if request == last.request:
            s.counts.retries += 1
            return {"session": header, "turn": last.index, "kind": "retry", "retry_of": last.receipt,
                    "sticky": last.release}
        # the reply it extends may be a retry's (same slot): it then links to that exact receipt
        target = s.by_reply.get(hashes[last.length]) if len(hashes) > last.length + 1 else None
        if target is not None and target.session == header and target.index == last.index:
            return _continued(target, convo[last.length + 1:])
        return _continued(last, convo[-1:])  # no transcript resent: the new message follows
    # no header: the longest open turn whose request plus reply this request extends
    for i in range(len(hashes) - 2, -1, -1):
        turn = s.by_reply.get(hashes[i])
        if turn is None or turn.explicit:
            continue
        if turn.fingerprint != frame:
            s.counts.side += 1
            return {"session": turn.session, "turn": None, "kind": "side", "sticky": turn.release}
        return _continued(turn, convo[i + 1:])
    first = s.by_request.get(request)
    if first is not None and not first.explicit and first.fingerprint == frame:
        s.counts.retries += 1
        return {"session": first.session, "turn": first.index, "kind": "retry", "retry_of": first.receipt,
                "sticky": first.release}
    s.counts.unlinked += mid
    return {"session": f"s-{receipt}", "turn": 0, "kind": "main", "unlinked": mid}


def _continued(previous: Turn, following: list[dict[str, Any]]) -> dict[str, Any]:
    state = [{"role": m.get("role"), "content": text_of(m.get("content")),
              **({"name": m["name"]} if isinstance(m.get("name"), str) else {})} for m in following]
    return {"session": previous.session, "turn": previous.index + 1, "kind": "main", "previous": previous.receipt,
            "next_state": state, "sticky": previous.release}


ROOT = "root"  # the owner of what the root tokens open, and of records written before sessions had owners


def owner_of(record: dict[str, Any]) -> str:
    """Who opened the session of a record (its `owner`, as reefd/api/access.py names it)."""
    owner = record.get("owner")
    return owner if isinstance(owner, str) else ROOT


class Conversations:
    """Places requests in sessions and remembers the turns still open, per scenario and owner."""

    def __init__(self, ttl_s: Callable[[str], float], clock: Callable[[], float] = time.time) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._open: dict[str, dict[str, _Open]] = {}  # scenario -> owner -> its open turns
        self._counts: dict[str, Counts] = {}
        self._listeners: list[Callable[[str, str], None]] = []

    def subscribe(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(scenario, receipt)` on the event loop when that turn's next state is durable."""
        self._listeners.append(listener)

    def linked(self, scenario: str, receipt: str) -> None:
        """The turn `receipt` got its next state (the caller stored the link)."""
        self._count(scenario).linked += 1
        for listener in list(self._listeners):
            try:
                listener(scenario, receipt)
            except Exception:  # a listener's bug must not fail a turn already answered
                log.exception("a conversation listener failed")

    def restore(self, scenario: str, record: dict[str, Any]) -> None:
        """Reopen a turn from its record (at start: the records of the last session_ttl_s, oldest first)."""
        c = record.get("conversation")
        if not isinstance(c, dict) or record.get("turn_kind") not in ("main", "retry"):
            return
        try:
            turn = Turn(record["id"], record["session"], int(record["turn"]), c["request"], c["reply"],
                        int(c["length"]), c["fingerprint"], float(record["created_at"]), bool(c["explicit"]),
                        record.get("release"))
        except (KeyError, TypeError, ValueError):
            return
        self._owned(scenario, owner_of(record)).open(turn, record["turn_kind"])

    def _count(self, scenario: str) -> Counts:
        return self._counts.get(scenario) or self._counts.setdefault(scenario, Counts())

    def _owned(self, scenario: str, owner: str) -> _Open:
        owners = self._open.get(scenario) or self._open.setdefault(scenario, {})
        return owners.get(owner) or owners.setdefault(owner, _Open(self._count(scenario)))  # built the first time

    def counts(self, scenario: str) -> dict[str, int]:
        self.expire(scenario)
        return {"open": sum(len(s.last) for s in self._open.get(scenario, {}).values()),
                **self._count(scenario).as_dict()}

    def place(self, scenario: str, receipt: str, header: str | None, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]], *, side: bool = False, owner: str = ROOT) -> Placement:
        """Decide the session and turn of a request (its messages as the client sent them) among `owner`'s open
        sessions; `side`: the client says it is a side call (x-reef-turn: side)."""
        self.expire(scenario)
        s = self._owned(scenario, owner)
        convo = conversation(messages)
        hashes = prefix_hashes(convo)
        frame = fingerprint(messages, tools)
        request = hashes[-1] if hashes else ""
        return Placement(request=request, length=len(convo), fingerprint=frame, explicit=header is not None,
                         **_decide(s, receipt, header, convo, hashes, frame, side))

    def scenario_of(self, header: str | None, messages: list[dict[str, Any]], owner: str = ROOT) -> str | None:
        """The scenario of `owner`'s open session a call continues, for a call that names none: the one whose open
        sessions hold its session header, or (without one) a served turn whose reply its transcript holds. A bare
        repeat of a first message is no evidence (two agents may both open with "hi"). None when no scenario's,
        or more than one's, does."""
        found = set()
        hashes = prefix_hashes(conversation(messages)) if header is None else []
        for name, owners in self._open.items():
            self.expire(name)
            s = owners.get(owner)
            if s is not None and (header in s.last if header is not None
                                  else any(h in s.by_reply for h in hashes[:-1])):
                found.add(name)
        return found.pop() if len(found) == 1 else None

    def forget_user(self, scenario: str, user: str) -> int:
        """Forget the open sessions of every owner that spoke for `user` (a user's deletion); returns how many."""
        owners = self._open.get(scenario, {})
        gone = [o for o in owners if o.endswith(f"/{user}")]
        for owner in gone:
            del owners[owner]
        return len(gone)

    def served(self, scenario: str, receipt: str, placement: Placement, reply: str,
               at: float | None = None, release: str | None = None, owner: str = ROOT) -> None:
        """A main or retry turn's record is durable: it is open for a continuation. `reply`: the hash of its
        request plus the served reply, `chain(placement.request, reply)` (the record's `conversation.reply`)."""
        if placement.kind not in ("main", "retry") or placement.session is None or placement.turn is None:
            return
        turn = Turn(receipt, placement.session, placement.turn, placement.request, reply, placement.length,
                    placement.fingerprint, self.clock() if at is None else at, placement.explicit, release)
        self._owned(scenario, owner).open(turn, placement.kind)

    def expire(self, scenario: str) -> None:
        """Forget the sessions idle for longer than the scenario's session_ttl_s; count them."""
        owners = self._open.get(scenario)
        if not owners:
            return
        cutoff = self.clock() - self.ttl_s(scenario)
        for name in list(owners):
            s = owners[name]
            s.counts.expired += s.expire(cutoff)
            if not s.last and not s.by_reply and not s.by_request:
                del owners[name]  # an owner with nothing open costs nothing

