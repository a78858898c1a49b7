"""reefctl users SCENARIO: a per-user scenario's users, what serves each, and their records and reports.

Standard library only: an HTTP client of GET /reef/scenarios/{name}/users.
"""

from __future__ import annotations

import argparse
import time
import urllib.parse

from reefd.cli.client import Client
from reefd.cli.kit import Table, age, cell, command, note, print_json


def _users_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("-o", "--output", choices=["json"], help="json: the list as returned")


@command("users", "a per-user scenario's users: release, records, reports", _users_args)
def cmd_users(client: Client, args: argparse.Namespace) -> int:
    page = client.call("GET", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/users")
    if args.output == "json":
        print_json(page)
        return 0
    rows = page.get("data") or []
    if not rows:
        note(f"No users of {args.name} yet (at most {page.get('max')}).")
        return 0
    now = time.time()
    Table(["USER", "RELEASE", "OWN", "RECORDS", "REPORTS", "SINCE"]).emit([
        [u["user"], cell(u.get("release")), "yes" if u.get("own_release") == u.get("release") and
         u.get("own_release") else "-", str(u.get("records", 0)), str(u.get("reports", 0)),
         cell(age(now - u["since"]) if u.get("since") else None)] for u in rows])
    for u in rows:
        if u.get("why"):
            note(f"{u['user']}: {u['why']}")
    return 0
