"""Bearer/x-api-key authentication: where tokens come from, and what each request's token may do.

The root tokens may do everything. They come from REEF_TOKEN (comma-separated, for rotation), else from a
systemd credential ($CREDENTIALS_DIRECTORY/token), else from STATE/token, generated on first start (mode 0600).
Scoped tokens come from the tokens file (reefd/ops/tokens.py), re-read on SIGHUP.

Each route declares the scope it needs (reefd/app.py); the middleware answers 401 without a valid token and 403
when the token lacks that scope. Which scenarios a token covers is checked where a request names or reaches one
(reefd/api/access.py).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web

from reefd.api.errors import ApiError, render
from reefd.ops.tokens import FULL, Entry, Grant, digest
from reefd.ops.tokens import read as read_tokens_file

log = logging.getLogger("reefd.ops.auth")

# "/" answers agents' connectivity probes (HEAD /); /readyz answers Kubernetes' probes, which send no token
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz"})
AUTHENTICATED = web.RequestKey("reef_authenticated", bool)  # on open paths: whether a valid token came too
GRANT = web.RequestKey("reef_grant", Grant)  # what the request's token may do (absent on open paths without one)
ANY = "any"  # a route's scope: any valid token


def _split(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def load_tokens(state_dir: Path, env: dict[str, str] | None = None) -> list[str]:
    """The accepted tokens; generates and stores one when none is configured."""
    env = dict(os.environ) if env is None else env
    if env.get("REEF_TOKEN", "").strip():
        return _split(env["REEF_TOKEN"])
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if cred_dir and (Path(cred_dir) / "token").is_file():
        return _split((Path(cred_dir) / "token").read_text())
    path = state_dir / "token"
    if path.is_file():
        tokens = _split(path.read_text())
        if tokens:
            log.info("using the API token stored in %s", path)
            return tokens
    state_dir.mkdir(parents=True, exist_ok=True)
    token = "reef-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.chmod(path, 0o600)
    log.warning("no REEF_TOKEN configured: generated an API token and stored it in %s", path)
    return [token]


TINKER_KEY_PREFIX = "tml-"  # the Tinker SDK sends only keys that start so: TINKER_API_KEY=tml-<reef token>


def presented_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = request.headers.get("x-api-key") or None
    if key is not None and request.path.startswith("/api/v1/"):
        key = key.removeprefix(TINKER_KEY_PREFIX)
    return key


def matches(presented: str | None, tokens: list[str]) -> bool:
    """Constant-time comparison against every accepted token (no early exit)."""
    given = (presented or "").encode("utf-8", "surrogateescape")  # any header bytes compare
    ok = False
    for token in tokens:
        ok |= hmac.compare_digest(given, token.encode())
    return ok and bool(presented)


class Keyring:
    """The accepted tokens: the root ones, and the scoped ones of the tokens file (`reload` re-reads it)."""

    def __init__(self, root: list[str], file: Path | None = None) -> None:
        self.root, self.file = list(root), file
        self._scoped: list[Entry] = []

    def reload(self) -> int:
        """Re-read the tokens file; TokensFileError keeps the tokens read before. Returns how many it holds."""
        if self.file is not None:
            self._scoped = read_tokens_file(self.file)
        return len(self._scoped)

    def entries(self) -> list[Entry]:
        """The scoped tokens as last read."""
        return list(self._scoped)

    def grant(self, presented: str | None) -> Grant | None:
        """What `presented` may do, or None for no valid token. Compares against every token (no early exit)."""
        if not presented:
            return None
        found: Grant | None = FULL if matches(presented, self.root) else None
        if not self._scoped:
            return found
        wanted = digest(presented).encode()
        for entry in self._scoped:
            if hmac.compare_digest(wanted, entry.sha256.encode()) and found is None:
                found = entry.grant
        return found


KEYRING = web.AppKey("keyring", Keyring)
ROUTE_SCOPES = web.AppKey("route_scopes", Mapping)  # handler -> the scope it needs (reefd/app.py)


def auth_middleware(keyring: Keyring, scopes: Mapping[Callable[..., object], str]
                    ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """`scopes`: the scope each route handler needs (ANY: a valid token). A handler missing from it needs
    `admin`, so a route added without a scope is closed rather than open."""

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        given = presented_token(request)
        grant = keyring.grant(given)
        if request.path in OPEN_PATHS:
            request[AUTHENTICATED] = grant is not None
            if grant is not None:
                request[GRANT] = grant
            return await handler(request)
        if grant is None:
            message = ("missing API token: send 'Authorization: Bearer <token>' or 'x-api-key'"
                       if given is None else "invalid API token")
            return render(request, ApiError(401, message, code="invalid_api_key"))
        route = request.match_info.route
        scope = ANY if route.resource is None else scopes.get(route.handler, "admin")  # None: no route matched
        if scope != ANY and not grant.allows(scope):
            return render(request, ApiError(
                403, f"{grant.describe()} lacks the {scope!r} scope, which {request.method} "
                f"{route.resource.canonical if route.resource else request.path} needs", code="permission_denied"))
        request[AUTHENTICATED] = True
        request[GRANT] = grant
        return await handler(request)

    return check
