"""reefctl token create|list|revoke: the scoped tokens file (reefd/ops/tokens.py), written on this machine.

Standard library only. These verbs write the file and never call the daemon: reefd reads the file again on
SIGHUP, so a change takes effect with `systemctl reload reefd` (or `kill -HUP`).
"""

from __future__ import annotations

import argparse
import calendar
import os
import time
from pathlib import Path

from reefd.cli.client import Client, CliError, state_dir
from reefd.cli.kit import Table, age, cell, command, note, print_json
from reefd.ops.tokens import SCOPES, TokensFileError, create, parse_scopes, path_for, read, revoke

APPLY = "reefd accepts the change after `systemctl reload reefd` (or `kill -HUP` of its pid)"


def _scopes(text: str) -> frozenset[str]:
    try:
        return parse_scopes(text)
    except TokensFileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _token_args(p: argparse.ArgumentParser) -> None:
    where = argparse.ArgumentParser(add_help=False)  # before or after the verb, like the connection flags
    for parser in (p, where):
        parser.add_argument("--file", type=Path, default=argparse.SUPPRESS,
                            help="the tokens file (env REEF_TOKENS_FILE; else STATE/tokens.json)")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    c = verbs.add_parser("create", parents=[where], help="add a token and print it (shown only this once)",
                         description="Add a token and print it on stdout; the file keeps only its SHA-256.")
    c.add_argument("name", metavar="NAME")
    c.add_argument("--scope", type=_scopes, required=True, metavar="SCOPES",
                   help=f"comma-separated, of: {', '.join(SCOPES)} (admin implies read)")
    c.add_argument("--scenario", action="append", metavar="SCENARIO",
                   help="limit the token to this scenario (repeat for more; default: every scenario)")
    c.add_argument("--user", metavar="USER",
                   help="the token speaks for this user only, on scenarios that learn per user (users:)")
    c.add_argument("-o", "--output", choices=["json"], help="json: the entry and the token")
    ls = verbs.add_parser("list", parents=[where], help="the tokens (names, scopes, scenarios; never the tokens)")
    ls.add_argument("-o", "--output", choices=["json"])
    r = verbs.add_parser("revoke", parents=[where], help="remove a token")
    r.add_argument("name", metavar="NAME")


@command("token", "create, list or revoke scoped API tokens (the tokens file on this machine)", _token_args)
def cmd_token(client: Client, args: argparse.Namespace) -> int:
    path = getattr(args, "file", None) or path_for(state_dir(os.environ), os.environ)
    try:
        if args.verb == "create":
            scenarios = frozenset(args.scenario) if args.scenario else None
            token, entry = create(path, args.name, args.scope, scenarios, args.user)
            if args.output == "json":
                print_json({**entry.as_json(), "token": token})
            else:
                print(token, flush=True)
            note(f"token/{args.name} created in {path}; {APPLY}")
        elif args.verb == "revoke":
            revoke(path, args.name)
            note(f"token/{args.name} revoked in {path}; {APPLY}")
        else:
            entries = read(path)
            if args.output == "json":
                print_json({"file": str(path), "tokens": [e.as_json() for e in entries]})
            elif not entries:
                note(f"No scoped tokens in {path}.")
            else:
                now = time.time()
                rows = [[e.grant.name, e.prefix + "…" if e.prefix else "-",
                         ",".join(s for s in SCOPES if s in e.grant.scopes),
                         "*" if e.grant.scenarios is None else ",".join(sorted(e.grant.scenarios)),
                         e.grant.user or "*",
                         cell(age(now - _epoch(e.created_at)) if e.created_at else None)] for e in entries]
                Table(["NAME", "PREFIX", "SCOPES", "SCENARIOS", "USER", "AGE"]).emit(rows)
    except TokensFileError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from None
    return 0


def _epoch(stamp: str) -> float:
    try:
        return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return time.time()
