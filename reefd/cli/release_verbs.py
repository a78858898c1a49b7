"""reefctl's release-chain verbs: history, show, diff, rollback, promote, publish.

Standard library only; each verb is one admin API call (see reefd/api/releases.py for the routes).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tarfile
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from reefd.cli.client import Client, CliError
from reefd.cli.kit import Table, cell, command, note, print_json, printable

PUBLISH_TIMEOUT_S = 600.0  # an adapter upload, and reefd checking it against the base model, take a while
SPOOL_BYTES = 64 << 20  # a publish tar bigger than this is written to a temporary file, not kept in memory


def _release_id(text: str) -> str:
    """Accept `release/<id>` too, so `-o name` output can be fed back in."""
    return text.removeprefix("release/")


def _history_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("--all", action="store_true", help="include rejected candidates")
    p.add_argument("--user", metavar="USER", help="a user's own release line (scenarios with a users: block)")
    p.add_argument("-o", "--output", choices=["json", "name"],
                   help="json: the list as returned; name: release/<id>, newest first")


def _decorations(rel: Mapping[str, Any], page: Mapping[str, Any]) -> str:
    """git log's `(HEAD -> main)`: where the chain's head, the serving release and the declared pin point."""
    marks = []
    serving = rel["id"] == page.get("serving")
    if rel["id"] == page.get("head"):
        marks.append("HEAD -> serving" if serving else "HEAD")
    elif serving:
        marks.append("serving")
    if rel["id"] == page.get("declared"):
        marks.append("pinned")
    if rel.get("status") == "rejected":
        marks.append("rejected")
    return f" ({', '.join(marks)})" if marks else ""


def _log_entry(rel: Mapping[str, Any], page: Mapping[str, Any]) -> str:
    meta = rel.get("meta") or {}
    lines = [f"release {rel['id']}{_decorations(rel, page)}", f"Kind:    {cell(rel.get('kind'))}",
             f"Parent:  {cell(rel.get('parent'))}", f"Date:    {cell(rel.get('created_at'))}",
             f"Source:  {cell(meta.get('source'))}"]
    if meta.get("target"):
        lines.append(f"Target:  {meta['target']}")
    notes = [printable(line) for line in str(meta.get("summary") or "").strip().splitlines()]
    gate = meta.get("gate")
    if isinstance(gate, dict) and gate.get("verdict"):
        notes.append(f"gate: {gate['verdict']}")
    return "\n".join(lines + ([""] + [f"    {note}" for note in notes] if notes else [])) + "\n"


@command("history", "a scenario's release chain, newest first (git log style)", _history_args)
def cmd_history(client: Client, args: argparse.Namespace) -> int:
    path = f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/releases"
    query = {**({"all": 1} if args.all else {}), **({"user": args.user} if args.user else {})}
    page = client.call("GET", path, query=query or None)
    if page.get("own_line") is False and args.output is None:
        note(f"user {args.user} has no release of their own: the shared line serves them")
    if args.output == "json":
        print_json(page)
        return 0
    for rel in page.get("data") or []:
        print(f"release/{rel['id']}" if args.output == "name" else _log_entry(rel, page), flush=True)
    return 0


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("release", metavar="RELEASE", type=_release_id)
    p.add_argument("-o", "--output", choices=["json"], help="json: release.json and the files")


@command("show", "one release: its metadata and files", _show_args)
def cmd_show(client: Client, args: argparse.Namespace) -> int:
    rel = client.call("GET", f"/reef/releases/{urllib.parse.quote(args.release, safe='')}")
    if args.output == "json":
        print_json(rel)
        return 0
    print_json({k: v for k, v in rel.items() if k != "files"})
    table = Table(["FILE", "SIZE", "SHA256", "LFS"])
    table.emit([[f["path"], str(f["size"]), f["sha256"][:12], "yes" if f["lfs"] else "-"] for f in rel["files"]])
    return 0


def _explain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("release", metavar="RELEASE", type=_release_id)
    p.add_argument("--depth", default="1", metavar="N",
                   help="how many releases from this one back: a number, or all (back to the base)")
    p.add_argument("-o", "--output", choices=["json"], help="json: the lineage as returned")


@command("explain", "what a release learned from: recipe, job and its parameters, gate, the proposer's answer "
                    "and harness diff, records and their reports", _explain_args)
def cmd_explain(client: Client, args: argparse.Namespace) -> int:
    lineage = client.call("GET", f"/reef/releases/{urllib.parse.quote(args.release, safe='')}/lineage",
                          query={"depth": args.depth})
    if args.output == "json":
        print_json(lineage)
        return 0
    for n, rel in enumerate(lineage.get("releases") or []):
        print(("" if n == 0 else "\n") + f"release/{rel.get('id')}  {rel.get('kind')}  {rel.get('status')}  "
              f"{rel.get('created_at')}", flush=True)
        job = rel.get("job")
        job_id = job.get("id") if isinstance(job, dict) else job
        users = ", ".join(str(u) for u in rel.get("users") or []) or None  # whose records it learned from
        for label, value in (("Parent", rel.get("parent")), ("Recipe", rel.get("recipe")),
                             ("Summary", rel.get("summary")), ("Job", job_id), ("Users", users)):
            if value is not None:
                print(f"  {label + ':':<9}{_value(value)}")
        params = rel.get("params")
        if isinstance(params, dict) and params:
            print("  Params:")
            for key in sorted(params, key=lambda k: (k not in ("recipe", "recipe_params"), k)):  # the recipe first
                print(f"    {printable(str(key))}: {_value(params[key])}")
        for label, value in (("Metrics", rel.get("metrics")), ("Gate", rel.get("gate")), ("Canary", rel.get("canary"))):
            if value is not None:
                print(f"  {label + ':':<9}{_value(value)}")
        _block("Proposer's answer", rel.get("proposal"))
        for m in rel.get("mutations") or []:
            named = isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("op", "kind", "id"))
            print(f"  Mutation: {printable(' '.join((m['op'], m['kind'], m['id']))) if named else _value(m)}")
        _block(f"Harness diff (reefctl diff {rel.get('parent')} {rel.get('id')})", rel.get("harness_diff"))
        learned = rel.get("learned_from") or []
        if learned:
            print(f"  Learned from {len(learned)} records (reefctl get record RECEIPT):")
            table = Table(["    RECEIPT", "REPORTS", "SCORES", "SOURCES"])
            table.emit([["    " + ("(deleted) " if r.get("deleted") else "") + str(r.get("receipt")),
                         str(len(r.get("reports") or [])),
                         ",".join(cell(x.get("score")) for x in r.get("reports") or []) or "-",
                         ",".join(sorted({str(x.get("source")) for x in r.get("reports") or []})) or "-"]
                        for r in learned])
    return 0


def _block(label: str, text: Any) -> None:
    """A multi-line text of a lineage (a proposer's answer, a diff), indented under its label."""
    if isinstance(text, str) and text:
        print(f"  {label}:")
        print("".join(f"    {printable(line.expandtabs(4))}\n" for line in text.splitlines()), end="")


def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", type=_release_id, help="the older release")
    p.add_argument("b", metavar="B", type=_release_id, help="the newer release")
    p.add_argument("-o", "--output", choices=["json"], help="json: the diff as returned")


def _value(value: Any) -> str:
    """A metadata value on one line: `-` for none, a one-line string as it is, anything else as JSON."""
    if value is None:
        return "-"
    if isinstance(value, str) and value and value.isprintable():
        return value
    return printable(json.dumps(value, ensure_ascii=False))


@command("diff", "what changed from release A to B: kind, metadata, files, text", _diff_args)
def cmd_diff(client: Client, args: argparse.Namespace) -> int:
    diff = client.call("GET", "/reef/diff", query={"a": args.a, "b": args.b})
    if args.output == "json":
        print_json(diff)
        return 0
    lines = []
    kinds = diff.get("kind") or [None, None]
    if kinds[0] != kinds[-1]:
        lines.append(f"kind: {cell(kinds[0])} -> {cell(kinds[-1])}")
    for key, (old, new) in sorted((diff.get("meta") or {}).items()):
        lines.append(f"meta.{key}: {_value(old)} -> {_value(new)}")
    files = [(path, status) for status, key in (("A", "added"), ("D", "removed"), ("M", "changed"))
             for path in diff.get(key) or []]
    lines += [f"{status}\t{path}" for path, status in sorted(files)]  # git diff --name-status
    texts = [text if text.endswith("\n") else text + "\n" for _, text in sorted((diff.get("text") or {}).items())]
    if not (lines or texts):
        note(f"No differences between {args.a} and {args.b}.")
    sys.stdout.write("".join(f"{line}\n" for line in lines) + ("\n" if lines and texts else "") + "".join(texts))
    sys.stdout.flush()
    return 0


def _write_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="ask reefd what would happen; change nothing")
    p.add_argument("--user", metavar="USER", help="a user's own release line (scenarios with a users: block)")
    p.add_argument("--expected-head", metavar="RELEASE", type=_release_id,
                   help="refuse (409 head_conflict) unless the chain's head is still this release")
    p.add_argument("-o", "--output", choices=["json"], help="json: reefd's answer as returned")


def _rollback_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("--to", "--to-release", dest="to", metavar="RELEASE", type=_release_id,
                   help="the release to go back to (default: reefd picks the previous one)")
    _write_args(p)


def _move(client: Client, args: argparse.Namespace, route: str, body: dict[str, Any], done: str, would: str) -> int:
    """POST a rollback or promote; print what moved, or what would have."""
    body["dry_run"] = args.dry_run
    if args.expected_head:
        body["expected_head"] = args.expected_head
    if args.user:
        body["user"] = args.user
    answer = client.call("POST", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/{route}", body=body)
    if args.output == "json":
        print_json(answer)
        return 0
    was, to = cell(answer.get("from")), cell(answer.get("to"))
    if answer.get("dry_run"):
        print(f"would {would} {args.name} from {was} to {to} (dry run; nothing changed)")
    else:
        new = (answer.get("release") or {}).get("id")
        whose = f" (user {args.user})" if args.user else ""
        print(f"scenario {args.name}{whose} {done} {to} as {cell(new)} (was {was}); serving "
              f"{cell(answer.get('serving'))}{trial_note(answer)}")
    return 0


def trial_note(answer: dict[str, Any]) -> str:
    """`, r5-… on canary for 10% of sessions` when the new head is on trial."""
    trial = answer.get("trial")
    if not isinstance(trial, dict):
        return ""
    share = trial.get("share")
    if trial.get("mode") == "shadow":
        return f", {cell(trial.get('release'))} on shadow trial (answering copies of {share:.0%} of sessions)"
    return f", {cell(trial.get('release'))} on canary for {share:.0%} of sessions"


@command("rollback", "append a copy of an earlier release as the new head", _rollback_args)
def cmd_rollback(client: Client, args: argparse.Namespace) -> int:
    return _move(client, args, "rollback", {"to": args.to}, "rolled back to", "roll back")


def _promote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("release", metavar="RELEASE", type=_release_id, help="the release to make the new head")
    _write_args(p)


@command("promote", "append a copy of a release as the new head", _promote_args)
def cmd_promote(client: Client, args: argparse.Namespace) -> int:
    return _move(client, args, "promote", {"release": args.release}, "promoted", "promote")


def _publish_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--adapter", metavar="DIR", type=Path,
                      help="a LoRA adapter folder (adapter_config.json, adapter_model.safetensors); reefd checks it")
    what.add_argument("--weights", metavar="DIR", type=Path,
                      help="a full HF model folder (config.json, *.safetensors, the base's tokenizer files) with the "
                           "base model's architecture; reefd checks it and rolls it across the engine's replicas")
    p.add_argument("--summary", metavar="TEXT", help="one line for the history")
    p.add_argument("--user", metavar="USER", help="publish an adapter on this user's own line (it serves only them)")
    p.add_argument("--expected-head", metavar="RELEASE", type=_release_id,
                   help="refuse (409 head_conflict) unless the chain's head is still this release")
    p.add_argument("-o", "--output", choices=["json", "name"], help="json: reefd's answer; name: release/<id>")


def _walk(folder: Path, prefix: str = "") -> Iterator[tuple[str, Path, os.stat_result]]:
    """(name in the archive, path, lstat) under `folder`, parents first; anything but a file or folder is refused."""
    for path in sorted(folder.iterdir()):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            raise CliError(f"refusing symbolic link {path}: a published folder may hold only files and folders")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise CliError(f"refusing {path}: not a regular file or folder")
        yield prefix + path.name, path, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(path, f"{prefix}{path.name}/")


def _tar_contents(folder: Path, out: IO[bytes]) -> None:
    """An uncompressed tar of `folder`'s contents, names relative to it. Members are built from lstat, so a
    hard link goes in as a plain file and no owner names leak out."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path, st in _walk(folder):
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.size = st.st_size
            with path.open("rb") as f:
                tar.addfile(info, f)


@command("publish", "append an adapter or full-weights release to a scenario's chain", _publish_args)
def cmd_publish(client: Client, args: argparse.Namespace) -> int:
    kind = "weights" if args.weights is not None else "adapter"
    folder: Path = args.weights if args.weights is not None else args.adapter
    if not folder.is_dir():
        raise CliError(f"--{kind} {folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    query = {"kind": kind}
    for key, value in (("expected_head", args.expected_head), ("summary", args.summary), ("user", args.user)):
        if value is not None:
            query[key] = value
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as tar:
        try:
            _tar_contents(folder, tar)
        except OSError as exc:
            raise CliError(f"cannot read {exc.filename or folder}: {exc.strerror or exc}") from None
        size = tar.tell()
        tar.seek(0)
        answer = client.call("POST", f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/releases",
                             query=query, data=tar, timeout=PUBLISH_TIMEOUT_S * (6 if kind == "weights" else 1),
                             headers={"Content-Type": "application/x-tar", "Content-Length": str(size)})
    rel_id = (answer.get("release") or {}).get("id")
    if args.output == "json":
        print_json(answer)
    elif args.output == "name":
        print(f"release/{rel_id}", flush=True)
    else:
        whose = f" (user {args.user})" if args.user else ""
        print(f"release/{rel_id} published to {args.name}{whose}; serving {cell(answer.get('serving'))}"
              f"{trial_note(answer)}", flush=True)
    for warning in answer.get("warnings") or []:
        note(f"reefctl: warning: {warning}")
    return 0
