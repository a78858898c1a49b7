"""reefctl's Grow verbs: train (start a job, optionally follow it with a progress bar), jobs and cancel.

Standard library only; each verb is an admin API call (see reefd/api/jobs.py for the routes).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from reefd.cli.client import Client, CliError
from reefd.cli.kit import Table, age, cell, command, note, print_json, printable

FINISHED = ("published", "rejected", "failed", "skipped", "cancelled")
POLL_S = 0.5
BAR = 24


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("-f", "--follow", action="store_true", help="show the job's progress until it ends")
    p.add_argument("--user", metavar="USER", help="train this user's own line, on their records alone")
    p.add_argument("--promote", action="store_true",
                   help="promote into the shared line what consenting users' releases learned (users.share)")
    p.add_argument("-o", "--output", choices=["json", "name"], help="json: the job; name: job/<id>")


def progress_line(job: Mapping[str, Any]) -> str:
    """`train [#########---------------] step 3/8 loss 0.4121 512 tok/s` (or the stage alone)."""
    p = job.get("progress") or {}
    stage = job.get("stage") or job.get("state")
    if stage != "train" or not p.get("steps"):
        return f"{job['id']}: {stage}"
    done = min(1.0, float(p.get("step", 0)) / float(p["steps"]))
    bar = "#" * round(done * BAR) + "-" * (BAR - round(done * BAR))
    loss = p.get("loss")
    speed = p.get("tokens_per_s")
    return (f"{job['id']}: train [{bar}] step {p.get('step', 0)}/{p['steps']}"
            + (f" loss {loss:.4f}" if isinstance(loss, int | float) else "")
            + (f" {speed:.0f} tok/s" if isinstance(speed, int | float) else ""))


def staleness_cell(staleness: Mapping[str, Any] | None) -> str:
    """A batch's staleness in releases behind the job's base: `0-2` (min-max), `1`, `inf` for a sample from a
    release no longer in the chain, with `(3 dropped)` or `(2 weighted)` past max_staleness; `-` without samples."""
    if not staleness:
        return "-"
    low, high = staleness.get("min"), staleness.get("max")
    if staleness.get("off_chain"):
        low, high = "inf" if low is None else low, "inf"
    text = "-" if low is None else str(low) if low == high else f"{low}-{high}"
    past = [f"{staleness[k]} {k}" for k in ("dropped", "weighted") if staleness.get(k)]
    return text + (f" ({', '.join(past)})" if past else "")


def outcome(job: Mapping[str, Any]) -> str:
    state = job["state"]
    if state == "published":
        return f"job/{job['id']} published {job['release']} (serving on the next request)"
    if state == "rejected":
        verdict = job.get("verdict") or {}
        return f"job/{job['id']} rejected candidate {job.get('release')}: {verdict.get('reason') or 'refused'}"
    return f"job/{job['id']} {state}: {job.get('error') or ''}".rstrip(": ")


@command("train", "start a training job for a scenario now (one per scenario at a time)", _train_args)
def cmd_train(client: Client, args: argparse.Namespace) -> int:
    body = {**({"user": args.user} if args.user else {}), **({"promote": True} if args.promote else {})}
    job = client.call("POST", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/train", body=body)
    if not args.follow:
        if args.output == "json":
            print_json(job)
        else:
            print(f"job/{job['id']}" + ("" if args.output == "name" else f" {job['state']}"))
        return 0
    tty = sys.stderr.isatty()
    shown = ""
    while job["state"] not in FINISHED:
        line = progress_line(job)
        if line != shown:
            print(("\r\033[K" if tty else "") + line, end="" if tty else "\n", file=sys.stderr, flush=True)
            shown = line
        time.sleep(POLL_S)
        job = client.call("GET", f"/reef/jobs/{urllib.parse.quote(job['id'], safe='')}")
    if tty:
        print(file=sys.stderr)
    if args.output == "json":
        print_json(job)
    else:
        print(outcome(job))
    return 0 if job["state"] in ("published", "rejected", "skipped") else 1


def _jobs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO", nargs="?", help="only this scenario's jobs")
    p.add_argument("-o", "--output", choices=["json", "name"], help="json: the list; name: job/<id>")


@command("jobs", "list training jobs, newest first", _jobs_args)
def cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    page = client.call("GET", "/reef/jobs", query={"scenario": args.name} if args.name else None)
    if args.output == "json":
        print_json(page)
        return 0
    if args.output == "name":
        for job in page["data"]:
            print(f"job/{job['id']}")
        return 0
    if not page["data"]:
        note("No jobs.")
        return 0
    now = time.time()
    table = Table(["JOB", "SCENARIO", "STATE", "STAGE", "TRIGGER", "RECORDS", "STALENESS", "RELEASE", "AGE", "MESSAGE"])
    table.emit([[j["id"], j["scenario"], j["state"], cell(j.get("stage")), j["reason"], str(len(j["receipts"])),
                 staleness_cell(j.get("staleness")), cell(j.get("release")), age(now - j["created_at"]),
                 cell(j.get("error") or (j.get("verdict") or {}).get("reason"))] for j in page["data"]])
    return 0


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB", help="the job's id (job/<id> also works), from `reefctl jobs`")
    p.add_argument("-o", "--output", choices=["json", "name"], help="json: the job; name: job/<id>")


@command("cancel", "stop a queued or running training job; nothing is published", _cancel_args)
def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    job_id = args.job.removeprefix("job/")
    job = client.call("POST", f"/reef/jobs/{urllib.parse.quote(job_id, safe='')}/cancel", body={})
    if args.output == "json":
        print_json(job)
    else:
        print(f"job/{job['id']}" + ("" if args.output == "name" else f" {job['state']}"))
    return 0


def _archive_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("--top", type=int, default=5, help="how many of the best states to list (default 5)")
    p.add_argument("-o", "--output", choices=["json"], help="json: the archive as the API returns it")


def _num(value: Any, fmt: str = ".4g") -> str:
    return "-" if not isinstance(value, int | float) else format(value, fmt)


@command("archive", "show a search scenario's archive: its best state and the best-so-far curve per step",
         _archive_args)
def cmd_archive(client: Client, args: argparse.Namespace) -> int:
    doc = client.call("GET", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/archive",
                      query={"top": str(args.top)})
    if args.output == "json":
        print_json(doc)
        return 0
    best = doc["best"]
    state = "open" if doc.get("open") else "training" if doc.get("pending") else "waiting for a client"
    note(f"{doc['scenario']}: step {doc['step']} ({state}), {doc['states']} states, {doc['expansions']} groups "
         "expanded")
    print(f"BEST {best['id']}  score {_num(best.get('score'))}  step {cell(best.get('step'))}  release "
          f"{cell(best.get('release'))}")
    for line in printable(best.get("state") or "").splitlines() or [""]:
        print("    " + line)
    curve = doc.get("curve") or []
    if curve:
        print()
        table = Table(["STEP", "STATE", "RELEASE", "ATTEMPTS", "MEAN", "MAX", "BEST-SO-FAR", "BETA", "DROPPED",
                       "PRODUCED"])
        table.emit([[str(e["step"]), e.get("state", "-"), cell(e.get("release")), str(e.get("attempts", "-")),
                     _num(e.get("mean")), _num(e.get("max")), _num(e.get("best_so_far")),
                     ",".join(_num(b, ".3g") for b in e.get("betas") or []) or "-",
                     ",".join(str(g) for g in e.get("dropped") or []) or "-",
                     cell(e.get("produced") or e.get("reason"))] for e in curve])
    return 0


__all__ = ["CliError", "cmd_archive", "cmd_cancel", "cmd_jobs", "cmd_train"]
