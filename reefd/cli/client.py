"""The admin API's HTTP client for reefctl: where the daemon and token are, and readable errors.

Standard library only (reefctl must start fast); knows nothing of the daemon's internals.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

DEFAULT_URL = "http://127.0.0.1:8900"
TIMEOUT_S = 30.0


class CliError(Exception):
    """A failure worth one line on stderr; `code` is the exit status."""
    code = 1


class Unreachable(CliError):
    """The daemon did not answer at all (refused, reset, timed out)."""


def state_dir(env: Mapping[str, str]) -> Path:
    """STATE: $REEF_STATE, else $STATE_DIRECTORY (systemd's, first of a colon list), else ~/.local/state/reefd."""
    systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(env.get("REEF_STATE") or systemd or Path.home() / ".local/state/reefd")


def _token_file(env: Mapping[str, str]) -> str | None:
    """First line of STATE/token."""
    path = state_dir(env) / "token"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        print(f"reefctl: warning: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return None
    return next((line for line in text.splitlines() if line.strip()), None)


def resolve_connection(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str | None]:
    """(url, token): explicit flags override the environment, which overrides the state dir's token file."""
    url = getattr(args, "url", None) or env.get("REEF_URL") or DEFAULT_URL
    token = getattr(args, "token", None) or env.get("REEF_TOKEN") or _token_file(env) or ""
    return url.rstrip("/"), token.split(",")[0].strip() or None  # a rotation list "new,old": send the first


class Client:
    """JSON over HTTP to reefd; every failure becomes a CliError with a readable message."""

    def __init__(self, url: str, token: str | None, timeout: float = TIMEOUT_S) -> None:
        try:
            parts = urllib.parse.urlsplit(url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port that is not a number, or out of range
            valid = False
        if not valid:
            raise CliError(f"bad reefd URL {url!r}: expected http://HOST:PORT")
        self.url, self.token, self.timeout = url, token, timeout

    def call(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
             body: Any = None, headers: Mapping[str, str] | None = None,
             data: bytes | IO[bytes] | None = None, timeout: float | None = None) -> Any:
        """`body` goes as JSON; `data` goes as is, with the Content-Type (and, for a file, the
        Content-Length) given in `headers`. `timeout` overrides the client's for this call."""
        sent = {"Accept": "application/json", **(headers or {})}
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        with self._open(method, path, query, sent, data, timeout) as resp:
            try:
                raw = resp.read()
            except OSError as exc:  # reset or timed out mid-answer
                raise self._unreachable(exc) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CliError(f"{method} {path}: reefd answered with something other than JSON") from None

    def lines(self, path: str, *, query: Mapping[str, Any] | None = None) -> Iterator[bytes]:
        """GET `path` and yield its body's lines as they arrive (a JSON lines stream), never all of it at once.
        A stream cut before its end is a CliError, as is any answer `call` would refuse."""
        with self._open("GET", path, query, {"Accept": "application/x-ndjson"}, None, None) as resp:
            try:
                rest = b""
                while block := resp.read1(1 << 16):  # raises IncompleteRead on a chunked body cut short, where
                    *lines, rest = (rest + block).split(b"\n")  # readline() would end quietly
                    yield from (line + b"\n" for line in lines)
                if rest:
                    yield rest
            except (OSError, http.client.HTTPException) as exc:
                raise CliError(f"GET {path}: the stream ended early ({type(exc).__name__}: {exc})") from None

    def _open(self, method: str, path: str, query: Mapping[str, Any] | None, headers: dict[str, str],
              data: bytes | IO[bytes] | None, timeout: float | None) -> http.client.HTTPResponse:
        target = self.url + path
        if query:
            target += "?" + urllib.parse.urlencode(query)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(target, data=data, method=method, headers=headers)
        try:
            resp: http.client.HTTPResponse = urllib.request.urlopen(
                req, timeout=self.timeout if timeout is None else timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise CliError(_http_error(exc.code, exc.reason, exc.read())) from None
        except OSError as exc:
            raise self._unreachable(exc) from None
        return resp

    def _unreachable(self, exc: OSError) -> Unreachable:
        """URLError wraps refused/unresolvable; resets and timeouts come bare."""
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        text = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
        return Unreachable(f"cannot reach reefd at {self.url}: {text}")


def _http_error(status: int, reason: str, raw: bytes) -> str:
    """The message of an OpenAI- or Anthropic-shaped error body ({"error": {"message"}}), else the text."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    message = err.get("message") if isinstance(err, dict) else err
    if not (message and isinstance(message, str)):
        message = raw.decode("utf-8", "replace").strip()[:300] or reason
    return f"HTTP {status}: {message}"
