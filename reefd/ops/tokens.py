"""Scoped API tokens: the tokens file, shared by reefd (which checks tokens) and reefctl (which writes them).

Standard library only (reefctl imports it). The file, STATE/tokens.json or $REEF_TOKENS_FILE, holds each
token's SHA-256, never the token itself, which is shown once when it is created:

    {"tokens": [{"name": "ci", "sha256": "9f2c…", "prefix": "reef_Ab3d", "scopes": ["report"],
                 "scenarios": ["hello"], "created_at": "2026-12-02T02:00:00Z"},
                {"name": "alice", "sha256": "…", "scopes": ["serve", "report"], "scenarios": ["assist"],
                 "user": "alice@example.com", "created_at": "…"}]}

Scopes: `serve` (the agent APIs and the harness), `report` (POST /reef/report), `read` (records, releases, jobs,
status, metrics) and `admin` (publish, rollback, promote, train, cancel); `admin` implies `read`.
`scenarios` limits a token to those scenarios; null or absent means every scenario. `user` makes every request of
the token that user's, on scenarios that learn per user (docs/users.md); it can never speak for another.
reefd reads the file at start and again on SIGHUP (`systemctl reload reefd`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reefd.ops.files import write_json

SCOPES = ("serve", "report", "read", "admin", "train")  # train: the Tinker API (reefd/api/tinker_routes.py)
_IMPLIED = {"admin": ("read",)}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX = re.compile(r"[0-9a-f]{64}")
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]*")
MAX_USER_CHARS = 128
PREFIX_CHARS = 9  # "reef_" and four more: enough to tell tokens apart in a list, far too few to guess one


class TokensFileError(ValueError):
    """The tokens file cannot be used as written; the message names the file and the problem."""


def user_problem(name: str) -> str | None:
    """Why `name` cannot name a user (it becomes a path and a git ref), or None: 1-128 letters, digits and
    `. _ @ + -`, starting with a letter or digit; no `/`, `..` or NUL, no `.` or `.lock` at the end."""
    if not name:
        return "is empty"
    if len(name) > MAX_USER_CHARS:
        return f"is longer than {MAX_USER_CHARS} characters"
    for bad, what in (("\0", "a NUL"), ("/", "'/'"), ("..", "'..'")):
        if bad in name:
            return f"holds {what}"
    if name.endswith((".", ".lock")):
        return "ends with '.' or '.lock'"
    if not _USER.fullmatch(name):
        return "may hold only letters, digits, '.', '_', '@', '+' and '-', and starts with a letter or digit"
    return None


@dataclass(frozen=True)
class Grant:
    """What a token may do: its scopes, the scenarios it is limited to (None: every scenario), and the user it
    speaks for (None: any, named per request by x-reef-user)."""

    name: str
    scopes: frozenset[str]
    scenarios: frozenset[str] | None = None
    user: str | None = None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or any(scope in _IMPLIED.get(s, ()) for s in self.scopes)

    def covers(self, scenario: str) -> bool:
        return self.scenarios is None or scenario in self.scenarios

    def visible(self, names: Iterable[str]) -> list[str]:
        return sorted(n for n in names if self.covers(n))

    def describe(self) -> str:
        where = "every scenario" if self.scenarios is None else "scenarios " + ", ".join(sorted(self.scenarios))
        whose = "" if self.user is None else f" for user {self.user!r}"
        return f"token {self.name!r} ({', '.join(sorted(self.scopes))} on {where}{whose})"


FULL = Grant("root", frozenset(SCOPES))  # REEF_TOKEN, the systemd credential, STATE/token


@dataclass(frozen=True)
class Entry:
    """One line of the file."""

    grant: Grant
    sha256: str
    prefix: str
    created_at: str

    def as_json(self) -> dict[str, Any]:
        scenarios = None if self.grant.scenarios is None else sorted(self.grant.scenarios)
        return {"name": self.grant.name, "sha256": self.sha256, "prefix": self.prefix,
                "scopes": [s for s in SCOPES if s in self.grant.scopes], "scenarios": scenarios,
                **({"user": self.grant.user} if self.grant.user is not None else {}), "created_at": self.created_at}


def path_for(state_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env["REEF_TOKENS_FILE"]) if env.get("REEF_TOKENS_FILE") else state_dir / "tokens.json"


def digest(token: str) -> str:
    """SHA-256 of the token's bytes. Tokens are 256 random bits, so a fast hash is the right one."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def new_token() -> str:
    return "reef_" + secrets.token_urlsafe(32)


def parse_scopes(text: str) -> frozenset[str]:
    """`serve,report` → the scopes; TokensFileError names an unknown one."""
    scopes = [s.strip() for s in text.split(",") if s.strip()]
    if not scopes:
        raise TokensFileError(f"no scope given; scopes are {', '.join(SCOPES)}")
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise TokensFileError(f"unknown scope {unknown[0]!r}; scopes are {', '.join(SCOPES)}")
    return frozenset(scopes)


def _entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise TokensFileError(f"{where}: must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TokensFileError(f"{where}: name must be 1-64 letters, digits, '.', '_' or '-'")
    sha = raw.get("sha256")
    if not isinstance(sha, str) or not _HEX.fullmatch(sha):
        raise TokensFileError(f"{where} ({name}): sha256 must be 64 lowercase hex digits (the token's SHA-256, "
                              "never the token)")
    scopes = raw.get("scopes")
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        raise TokensFileError(f"{where} ({name}): scopes must be a list of {', '.join(SCOPES)}")
    try:
        granted = parse_scopes(",".join(scopes))
    except TokensFileError as exc:
        raise TokensFileError(f"{where} ({name}): {exc}") from None
    scenarios = raw.get("scenarios")
    if scenarios is not None and (not isinstance(scenarios, list) or not scenarios
                                  or not all(isinstance(s, str) and s for s in scenarios)):
        raise TokensFileError(f"{where} ({name}): scenarios must be a non-empty list of names, or null for "
                              "every scenario")
    user = raw.get("user")
    if user is not None:
        problem = user_problem(user) if isinstance(user, str) else "is not a string"
        if problem is not None:
            raise TokensFileError(f"{where} ({name}): user {user!r} {problem}")
    return Entry(Grant(name, granted, None if scenarios is None else frozenset(scenarios), user), sha,
                 str(raw.get("prefix") or ""), str(raw.get("created_at") or ""))


def read(path: Path) -> list[Entry]:
    """The file's tokens ([] when there is no file: deleting it revokes every scoped token); TokensFileError when
    it cannot be used as written. An empty file is refused: it is what an interrupted write or `> tokens.json`
    leaves, not a list of no tokens (that is `{"tokens": []}`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise TokensFileError(f"{path}: cannot read it: {exc}") from None
    if not text.strip():
        raise TokensFileError(f'{path}: is empty (no tokens at all is {{"tokens": []}})')
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokensFileError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
        raise TokensFileError(f'{path}: must be an object {{"tokens": [...]}}')
    entries = [_entry(raw, f"{path}: tokens[{i}]") for i, raw in enumerate(doc["tokens"])]
    seen: set[str] = set()
    for e in entries:
        if e.grant.name in seen:
            raise TokensFileError(f"{path}: two tokens are named {e.grant.name!r}")
        if e.sha256 in seen:
            raise TokensFileError(f"{path}: token {e.grant.name!r} has the same sha256 as another one")
        seen |= {e.grant.name, e.sha256}
    return entries


def write(path: Path, entries: list[Entry]) -> None:
    """Replace the file atomically, readable by its owner only (under sudo: the folder's owner, reefd's user)."""
    write_json(path, {"tokens": [e.as_json() for e in entries]}, indent=2, private=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time (two `reefctl token` commands at once must not lose an entry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def create(path: Path, name: str, scopes: frozenset[str], scenarios: frozenset[str] | None,
           user: str | None = None) -> tuple[str, Entry]:
    """Add a token (for `user`'s requests only, when given); returns (the token, shown only now, its entry)."""
    if not _NAME.fullmatch(name):
        raise TokensFileError(f"{name!r} is not a token name (1-64 letters, digits, '.', '_' or '-')")
    if user is not None and (problem := user_problem(user)) is not None:
        raise TokensFileError(f"--user: {user!r} {problem}")
    if scenarios is not None and not scenarios:
        raise TokensFileError("--scenario: give at least one scenario, or none for every scenario")
    with _locked(path):
        entries = read(path)
        if any(e.grant.name == name for e in entries):
            raise TokensFileError(f"a token named {name!r} already exists in {path}; revoke it first or pick "
                                  "another name")
        token = new_token()
        entry = Entry(Grant(name, scopes, scenarios, user), digest(token), token[:PREFIX_CHARS],
                      time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        write(path, [*entries, entry])
    return token, entry


def revoke(path: Path, name: str) -> Entry:
    with _locked(path):
        entries = read(path)
        gone = next((e for e in entries if e.grant.name == name), None)
        if gone is None:
            known = ", ".join(e.grant.name for e in entries) or "none"
            raise TokensFileError(f"no token named {name!r} in {path} (tokens: {known})")
        write(path, [e for e in entries if e is not gone])
    return gone


def revoke_user(path: Path, scenario: str, user: str) -> tuple[list[str], list[str]]:
    """What deleting `user` from `scenario` does to the tokens made for them: those limited to that scenario
    alone are revoked; those that also reach other scenarios stay (the user still exists there).
    Returns (revoked names, kept names)."""
    with _locked(path):
        entries = read(path)
        theirs = [e for e in entries if e.grant.user == user and e.grant.covers(scenario)]
        gone = [e for e in theirs if e.grant.scenarios == frozenset({scenario})]
        if gone:
            write(path, [e for e in entries if e not in gone])
    return [e.grant.name for e in gone], [e.grant.name for e in theirs if e not in gone]
