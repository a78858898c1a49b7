"""Bearer/x-api-key authentication: where tokens come from and how requests are checked.

Tokens come from REEF_TOKEN (comma-separated, for rotation), else from a systemd credential
($CREDENTIALS_DIRECTORY/token), else from STATE/token, generated on first start (mode 0600).
Knows nothing about scenarios.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from reefd.api.errors import ApiError, render

log = logging.getLogger("reefd.auth")

# "/" answers agents' connectivity probes (HEAD /); /readyz answers Kubernetes' probes, which send no token
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz"})
AUTHENTICATED = web.RequestKey("reef_authenticated", bool)  # on open paths: whether a valid token came too


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


def presented_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


def matches(presented: str | None, tokens: list[str]) -> bool:
    """Constant-time comparison against every accepted token (no early exit)."""
    given = (presented or "").encode("utf-8", "surrogateescape")  # any header bytes compare
    ok = False
    for token in tokens:
        ok |= hmac.compare_digest(given, token.encode())
    return ok and bool(presented)


def auth_middleware(tokens: list[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        valid = matches(presented_token(request), tokens)
        if request.path in OPEN_PATHS or valid:
            request[AUTHENTICATED] = valid
            return await handler(request)
        given = presented_token(request)
        message = ("missing API token: send 'Authorization: Bearer <token>' or 'x-api-key'"
                   if given is None else "invalid API token")
        return render(request, ApiError(401, message, code="invalid_api_key"))

    return check
