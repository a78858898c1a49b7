"""reefctl users SCENARIO: a per-user scenario's users, what serves each, their records, reports and last job;
reefctl users delete SCENARIO USER: every byte of that user's removed; reefctl users share SCENARIO USER [--off]:
the user's consent to promotions.

Standard library only: an HTTP client of GET /reef/scenarios/{name}/users and PATCH and DELETE …/users/{user}.
"""

from __future__ import annotations

import argparse
import time
import urllib.parse

from reefd.cli.client import Client, CliError
from reefd.cli.kit import Table, age, cell, command, note, print_json


def _users_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("reefctl users SCENARIO [-o json] | reefctl users delete SCENARIO USER [-o json] | "
               "reefctl users share SCENARIO USER [--off]")
    p.add_argument("words", nargs="+", metavar="SCENARIO | delete SCENARIO USER | share SCENARIO USER")
    p.add_argument("--off", action="store_true", help="share: withdraw the user's consent")
    p.add_argument("-o", "--output", choices=["json"], help="json: reefd's answer as returned")


@command("users", "a per-user scenario's users (release, records, reports, last job), or delete one", _users_args)
def cmd_users(client: Client, args: argparse.Namespace) -> int:
    words = args.words
    if words[0] == "delete":
        if len(words) != 3:
            raise CliError("usage: reefctl users delete SCENARIO USER")
        return _delete(client, args, words[1], words[2])
    if words[0] == "share":
        if len(words) != 3:
            raise CliError("usage: reefctl users share SCENARIO USER [--off]")
        return _share(client, args, words[1], words[2])
    if len(words) != 1:
        raise CliError("usage: reefctl users SCENARIO (or: reefctl users delete SCENARIO USER)")
    args.name = words[0]
    page = client.call("GET", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/users")
    if args.output == "json":
        print_json(page)
        return 0
    rows = page.get("data") or []
    if not rows:
        note(f"No users of {args.name} yet (at most {page.get('max')}).")
        return 0
    now = time.time()
    Table(["USER", "RELEASE", "OWN", "SHARES", "RECORDS", "REPORTS", "LAST JOB", "SINCE"]).emit([
        [u["user"], cell(u.get("release")), "yes" if u.get("own_release") == u.get("release") and
         u.get("own_release") else "-", "yes" if u.get("share") else "-", str(u.get("records", 0)),
         str(u.get("reports", 0)),
         f"{u['last_job']['id']} {u['last_job']['state']}" if u.get("last_job") else "-",
         cell(age(now - u["since"]) if u.get("since") else None)] for u in rows])
    for u in rows:
        if u.get("why"):
            note(f"{u['user']}: {u['why']}")
    return 0


def _path(scenario: str, user: str) -> str:
    return f"/reef/scenarios/{urllib.parse.quote(scenario, safe='')}/users/{urllib.parse.quote(user, safe='')}"


def _share(client: Client, args: argparse.Namespace, scenario: str, user: str) -> int:
    kept = client.call("PATCH", _path(scenario, user), body={"share": not args.off})
    if args.output == "json":
        print_json(kept)
        return 0
    print(f"user {user} of {scenario} {'shares' if kept.get('share') else 'no longer shares'} what their releases "
          "learned")
    if kept.get("share") and not kept.get("promotions"):
        note(f"{scenario} has no users.share: true, so nothing is promoted until it does")
    return 0


def _delete(client: Client, args: argparse.Namespace, scenario: str, user: str) -> int:
    gone = client.call("DELETE", _path(scenario, user))
    if args.output == "json":
        print_json(gone)
        return 0
    print(f"user {user} of {scenario} deleted: {gone.get('records', 0)} records, {len(gone.get('releases') or [])} "
          f"releases, {gone.get('jobs', 0)} jobs, {gone.get('lfs_objects', 0)} LFS objects")
    for rel in gone.get("shared_releases_learned_from") or []:
        note(f"shared release {rel} learned from their records: retrain without them (docs/users.md)")
    for token in gone.get("tokens_revoked") or []:
        note(f"token {token} (made for {user} on {scenario} alone) is revoked")
    for token in gone.get("tokens_kept") or []:
        note(f"token {token} still speaks for {user} on other scenarios: reefctl token revoke {token}")
    return 0
