"""reefctl: a kubectl-style command line over reefd's admin HTTP API.

Standard library only, so it starts fast; knows the admin wire format and nothing of the daemon's internals.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from reefd.cli.client import DEFAULT_URL, Client, CliError, Unreachable, resolve_connection
from reefd.cli.kit import COMMANDS, Table, age, cell, command, json_arg, note, number, print_json, printable

PREVIEW = 60  # characters of completion shown in the records table (twice that with -o wide)


def _receipt(text: str) -> str:
    """Accept `record/<receipt>` too, so `-o name` output can be fed back in."""
    return text.removeprefix("record/")


def _get_record(client: Client, receipt: str) -> Any:
    return client.call("GET", f"/reef/records/{urllib.parse.quote(receipt, safe='')}")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=["json", "wide"], help="json: the raw status; wide: more columns")


def _drift(chain: Mapping[str, Any]) -> str:
    """The DRIFT cell: `-` in sync, else which pointer serving misses (the reasons follow the table)."""
    if not chain.get("drift"):
        return "-"
    if chain.get("serving") != (chain.get("declared") or chain.get("head")):
        return "serving!=pin" if chain.get("declared") else "serving!=head"
    return "yes"


@command("status", "show the daemon and each scenario's engine, release chain and counts", _status_args)
def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.call("GET", "/reef/status")
    if args.output == "json":
        print_json(status)
        return 0
    ready = "ready" if status.get("ready") else "NOT READY"
    note(f"reefd {status.get('version', '?')} at {client.url}, up {age(status.get('uptime_s'))}, {ready}")
    wide = args.output == "wide"
    scenarios = status.get("scenarios") or []
    chained = any(isinstance(sc.get("releases"), dict) for sc in scenarios)  # an older reefd has no chain
    rows, reasons = [], []
    for sc in scenarios:
        engine = sc.get("engine") or {}
        chain = sc.get("releases") if isinstance(sc.get("releases"), dict) else {}
        row = [sc.get("name"), sc.get("model"), engine.get("kind"), engine.get("state"), _queue(engine),
               sc.get("release"), sc.get("records"), sc.get("reports")]
        if chained:
            row += [chain.get("declared") or ("head" if chain else None), chain.get("head"),
                    chain.get("serving"), _drift(chain)]
        if wide:
            row += [chain.get("adapter")] if chained else []
            row += [engine.get("url"), engine.get("restarts"), engine.get("pid")]
        rows.append([cell(v) for v in row])
        reasons += [f"scenario {sc.get('name')}: drift: {printable(str(r))}" for r in chain.get("drift") or []]
        reasons += _conversation_lines(sc) + _practice_lines(sc)
    if not rows:
        note("No scenarios configured.")
    columns = ["SCENARIO", "MODEL", "ENGINE", "STATE", "QUEUE", "RELEASE", "RECORDS", "REPORTS"]
    if chained:
        columns += ["DECLARED", "HEAD", "SERVING", "DRIFT"] + (["ADAPTER"] if wide else [])
    if wide:
        columns += ["URL", "RESTARTS", "PID"]
    Table(columns).emit(rows)
    for line in reasons:
        print(line, flush=True)
    return 0


def _num(value: Any, sign: bool = False) -> str:
    return f"{value:+.3f}" if sign and isinstance(value, int | float) else \
        f"{value:.3f}" if isinstance(value, int | float) else "-"


def trial_line(t: Mapping[str, Any]) -> str:
    """`canary r5-… on 10% of sessions vs r4-…: scores 23/50 and 212/50; means 0.710 vs 0.650, diff +0.060,
    interval [-0.020, +0.140] at 95%; gathering …`."""
    c, s = t.get("canary") or {}, t.get("stable") or {}
    share = t.get("share")
    where = f"on {share:.0%} of sessions" if isinstance(share, int | float) else ""
    line = (f"{t.get('mode')} {t.get('release')} {where} vs {t.get('stable_release')}: scores "
            f"{c.get('n', 0)}/{t.get('min_reports')} and {s.get('n', 0)}/{t.get('min_reports')}; "
            f"means {_num(c.get('mean'))} vs {_num(s.get('mean'))}")
    interval = t.get("interval")
    if isinstance(interval, list) and len(interval) == 2:
        confidence = t.get("confidence")
        at = f" at {confidence:.0%}" if isinstance(confidence, int | float) else ""
        line += (f", diff {_num(t.get('diff'), True)}, interval [{_num(interval[0], True)}, "
                 f"{_num(interval[1], True)}]{at}")
    age, limit = t.get("age_s"), t.get("max_age_s")
    if isinstance(age, int | float) and isinstance(limit, int | float):
        line += f"; {age:.0f} s of {limit:.0f} s"
    return printable(line + (f"; {t['reason']}" if t.get("reason") else ""))


def _queue(engine: Mapping[str, Any]) -> str | None:
    """RUNNING/TURNS+WAITING, e.g. 8/8+3: eight generating of eight turns, three waiting for one."""
    q = engine.get("queue") if isinstance(engine.get("queue"), dict) else None
    if q is None:
        return None
    return f"{q.get('running')}/{q.get('limit')}+{q.get('waiting')}"


def _practice_lines(sc: Mapping[str, Any]) -> list[str]:
    """What practice did, for a scenario that has a practice set, and its last error."""
    p = sc.get("practice") if isinstance(sc.get("practice"), dict) else None
    if p is None:
        return []
    out = [printable(f"scenario {sc.get('name')}: practice ({p.get('tasks')}, verifier {p.get('verifier')}): "
                     f"{p.get('rounds', 0)} rounds, {p.get('answers', 0)} answers, {p.get('passed', 0)} passed, "
                     f"{p.get('failed', 0)} failed, {p.get('verifier_errors', 0)} verifier errors, "
                     f"{p.get('answer_errors', 0)} without an answer, {p.get('yielded', 0)} stopped for requests, "
                     f"{p.get('generating', 0)} generating; "
                     f"{p.get('records', 0)} records stored")]
    last = p.get("last_error") if isinstance(p.get("last_error"), dict) else None
    if last is not None:
        out.append(printable(f"scenario {sc.get('name')}: practice: last error: {last.get('message')}"))
    return out


def _conversation_lines(sc: Mapping[str, Any]) -> list[str]:
    """Sessions and judging, for scenarios that have any: so that a failure to link turns is visible."""
    out = []
    sessions: Mapping[str, Any] = sc["sessions"] if isinstance(sc.get("sessions"), dict) else {}
    if any(sessions.get(k) for k in ("linked", "unlinked", "expired", "side", "retries")):
        out.append(f"scenario {sc.get('name')}: sessions: {sessions.get('open', 0)} open, "
                   f"{sessions.get('linked', 0)} turns linked, {sessions.get('unlinked', 0)} unlinked, "
                   f"{sessions.get('expired', 0)} expired, {sessions.get('side', 0)} side calls, "
                   f"{sessions.get('retries', 0)} retries")
    trial = sc.get("canary") if isinstance(sc.get("canary"), dict) else None
    if trial is not None:
        out.append(f"scenario {sc.get('name')}: {trial_line(trial)}")
    judge = sc.get("judge") if isinstance(sc.get("judge"), dict) else None
    if judge is not None:
        out.append(f"scenario {sc.get('name')}: judge: {judge.get('judged', 0)} judged "
                   f"(+1: {judge.get('positive', 0)}, -1: {judge.get('negative', 0)}, 0: {judge.get('neutral', 0)}, "
                   f"{judge.get('hinted', 0)} with hints), {judge.get('pending', 0)} pending, "
                   f"{judge.get('invalid_votes', 0)} invalid votes, {judge.get('unreachable', 0)} times unreachable")
    engine: Mapping[str, Any] = sc["engine"] if isinstance(sc.get("engine"), dict) else {}
    queue: Mapping[str, Any] = engine["queue"] if isinstance(engine.get("queue"), dict) else {}
    refused: Mapping[str, Any] = queue["refused"] if isinstance(queue.get("refused"), dict) else {}
    if refused:
        out.append(f"scenario {sc.get('name')}: queue: {refused.get('queue_full', 0)} refused with 429 (more than "
                   f"{queue.get('max_queue')} waiting), {refused.get('queue_timeout', 0)} with 503 (no turn within "
                   f"{queue.get('max_queue_wait_s')} s)")
    for r in engine.get("replicas") or []:
        health = "healthy" if r.get("healthy") else "unhealthy" if r.get("healthy") is False else "-"
        out.append(f"scenario {sc.get('name')}: replica {r.get('replica')} {r.get('url') or '-'}: {r.get('state')}, "
                   f"{health}{'' if r.get('in_router') else ', not in the router'}, release {r.get('release')}, "
                   f"weights {r.get('weights') or 'as launched'}, "
                   f"load {r.get('load') if r.get('load') is not None else '-'}, "
                   f"adapters {','.join(r.get('adapters') or []) or '-'}"
                   + (f", last error: {r['last_error']}" if r.get("last_error") else ""))
    swap = engine.get("last_swap") if isinstance(engine.get("last_swap"), dict) else None
    if swap is not None:
        out.append(f"scenario {sc.get('name')}: last weights swap: {swap.get('version')} on {swap.get('replicas')} "
                   f"process(es) in {swap.get('total_s', 0):.2f} s, new requests held {swap.get('held_s', 0):.2f} s")
    search = sc.get("search") if isinstance(sc.get("search"), dict) else None
    if search is not None:
        state = "open" if search.get("open") else "training" if search.get("training") else "waiting for a client"
        out.append(f"scenario {sc.get('name')}: search: step {search.get('step')} ({state}), "
                   f"{search.get('closed', 0)} steps closed ({search.get('discarded', 0)} discarded), best "
                   f"{search.get('best')} (reefctl archive {sc.get('name')})")
    return out


def completion_text(record: Mapping[str, Any]) -> str:
    """The answer's text: OpenAI choices[0].message.content, or Anthropic's text blocks joined."""
    response = record.get("response") or {}
    if str(record.get("api", "")).startswith("anthropic"):
        content = response.get("content")
        blocks = content if isinstance(content, list) else []
        calls = [b.get("name") for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    else:
        message = ((response.get("choices") or [{}])[0]).get("message") or {}
        content = message.get("content")
        calls = [(c.get("function") or {}).get("name") for c in message.get("tool_calls") or []]
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    text = content if isinstance(content, str) else ""
    if not text.strip() and calls:
        return "[tool call: " + ", ".join(str(c) for c in calls) + "]"
    return text


def latest_score(record: Mapping[str, Any]) -> float | None:
    """The score of the newest report that has one (a later feedback-only report does not hide it)."""
    scored = [r for r in record.get("reports") or [] if isinstance(r.get("score"), (int, float))]
    scored.sort(key=lambda r: r.get("created_at") or 0)  # stable: ties keep the server's order
    return scored[-1]["score"] if scored else None


def turn_cell(record: Mapping[str, Any]) -> str:
    """A turn's place in its session: its index, `retry` (of index) or `side`."""
    kind, turn = record.get("turn_kind"), record.get("turn")
    if kind == "side":
        return "side"
    if turn is None:
        return "-"
    return f"{turn} (retry)" if kind == "retry" else str(turn)


def judged(record: Mapping[str, Any]) -> str | None:
    """The judge's verdict on a turn, with how many hints it found (None: not judged)."""
    verdicts = [r for r in record.get("reports") or [] if r.get("source") == "judge"]
    if not verdicts:
        return None
    meta = verdicts[-1].get("metadata") or {}
    hints = len(meta.get("hints") or [])
    return f"{verdicts[-1].get('score'):+g}" + (f" +{hints} hint" + ("s" if hints > 1 else "") if hints else "")


def _record_row(record: Mapping[str, Any], wide: bool, turns: bool = False) -> list[str]:
    usage = record.get("usage") or {}
    created = record.get("created_at")
    score = latest_score(record)
    preview = printable(" ".join(completion_text(record).split()))
    limit = PREVIEW * (2 if wide else 1)
    if len(preview) > limit:
        preview = preview[: limit - 3] + "..."
    row = [record.get("id"), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)) if created else None,
           record.get("api"), f"{usage.get('prompt_tokens', '?')}+{usage.get('completion_tokens', '?')}",
           None if score is None else f"{score:g}"]
    if turns:
        row += [turn_cell(record), record.get("next"), judged(record)]
    if wide:
        latency = record.get("latency_s")
        row += [record.get("release"), record.get("session"),
                None if latency is None else f"{latency:.2f}s", record.get("finish_reason")]
    return [cell(v) for v in [*row, preview]]


Emit = Callable[[list[dict[str, Any]]], None]


def _record_printer(output: str | None, turns: bool = False) -> Emit:
    wide = output == "wide"
    extra = (["TURN", "NEXT", "JUDGE"] if turns else []) + (["RELEASE", "SESSION", "LATENCY", "FINISH"] if wide else [])
    table = Table(["RECEIPT", "CREATED", "API", "TOKENS", "SCORE", *extra, "COMPLETION"])

    def emit(batch: list[dict[str, Any]]) -> None:
        if output not in ("json", "name"):
            table.emit([_record_row(r, wide, turns) for r in batch])
        for record in batch if output == "json" else []:
            print_json(record, lines=True)
        for record in batch if output == "name" else []:
            print(f"record/{record['id']}", flush=True)

    return emit


def _pages(client: Client, scenario: str, after: str | None, limit: int | None,
           session: str | None = None, practice: str = "include") -> Iterator[list[dict[str, Any]]]:
    """Yield pages of records after `after`: one page of `limit`, or every page while has_more."""
    path = f"/reef/scenarios/{urllib.parse.quote(scenario, safe='')}/records"
    while True:
        query: dict[str, Any] = {"after": after} if after else {}
        if limit:
            query["limit"] = limit
        if session:
            query["session"] = session
        if practice != "include":
            query["practice"] = practice
        page = client.call("GET", path, query=query)
        data = page.get("data") or []
        yield data
        cursor = page.get("last_id") or (data[-1]["id"] if data else None)
        if limit or not page.get("has_more") or not cursor or cursor == after:
            return
        after = cursor


def _records_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("--after", metavar="RECEIPT", type=_receipt, help="start after this receipt")
    p.add_argument("--session", metavar="S", help="only this conversation's turns, in order, with each turn's "
                   "index, the turn that follows it and the judge's verdict")
    p.add_argument("--limit", metavar="N", type=number(int, positive=True),
                   help="show one page of at most N records (default: every page)")
    p.add_argument("--practice", choices=["include", "exclude", "only"], default="include",
                   help="reefd's own practice records (API `practice`): include (default), exclude or only them")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new records until Ctrl-C")
    p.add_argument("--interval", type=number(float, positive=True), default=1.0, help=argparse.SUPPRESS)
    p.add_argument("-o", "--output", choices=["json", "wide", "name"],
                   help="json: one record per line (JSON Lines); name: record/<receipt>; wide: more columns")


@command("records", "list a scenario's records, oldest first", _records_args)
def cmd_records(client: Client, args: argparse.Namespace) -> int:
    emit = _record_printer(args.output, turns=bool(args.session))
    cursor = args.after
    try:
        pages = _pages(client, args.name, cursor, args.limit, args.session, args.practice)
        if args.output in (None, "wide"):  # a table is aligned over the whole listing
            pages = iter([[r for page in pages for r in page]])
        for batch in pages:
            emit(batch)
            cursor = batch[-1]["id"] if batch else cursor
        if cursor == args.after and args.output in (None, "wide"):
            note(f"No records found in scenario {args.name}.")
        if args.follow:
            _follow(client, args, emit, cursor)
    except KeyboardInterrupt:
        if not args.follow:
            raise
    return 0


def _follow(client: Client, args: argparse.Namespace, emit: Emit, cursor: str | None) -> None:
    """Poll for records after `cursor` until Ctrl-C; a daemon restart is waited out, not fatal."""
    down = False
    while True:
        time.sleep(args.interval)
        try:
            for batch in _pages(client, args.name, cursor, None, args.session, args.practice):
                emit(batch)
                cursor = batch[-1]["id"] if batch else cursor
            down = False
        except Unreachable as exc:
            if not down:
                note(f"reefctl: {exc}; retrying every {args.interval:g}s")
            down = True


def _get_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=["record"])
    p.add_argument("name", metavar="RECEIPT", type=_receipt)
    p.add_argument("-o", "--output", choices=["json"], help="json (the default): the object, indented")


@command("get", "show one object as JSON: get record RECEIPT", _get_args)
def cmd_get(client: Client, args: argparse.Namespace) -> int:
    print_json(_get_record(client, args.name))
    return 0


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("receipts", metavar="RECEIPT", nargs="+", type=_receipt, help="the records the report is about")
    p.add_argument("--score", metavar="X", type=number(float), help="a finite number")
    feedback = p.add_mutually_exclusive_group()
    feedback.add_argument("--feedback", metavar="TEXT", help="free-text feedback")
    feedback.add_argument("--feedback-json", metavar="JSON", type=json_arg, help="structured feedback")
    p.add_argument("--metadata", metavar="JSON", type=functools.partial(json_arg, want=dict), help="a JSON object")
    p.add_argument("--report-id", metavar="ID", help="idempotency key: resending the same report is a no-op")
    p.add_argument("--scenario", metavar="NAME", help="default: the first receipt's scenario")
    p.add_argument("-o", "--output", choices=["json", "name"], help="json: the created report; name: report/<id>")


@command("report", "attach a score and/or feedback to records", _report_args)
def cmd_report(client: Client, args: argparse.Namespace) -> int:
    try:
        scenario = args.scenario or _get_record(client, args.receipts[0]).get("scenario")
    except CliError as exc:
        if str(exc).startswith("HTTP 403"):  # a token with `report` but not `read`
            raise CliError(f"{exc}; pass --scenario NAME to report without looking the record up") from None
        raise
    if not scenario:
        raise CliError(f"record {args.receipts[0]} names no scenario; pass --scenario")
    feedback = args.feedback if args.feedback is not None else args.feedback_json
    body: dict[str, Any] = {"references": args.receipts}
    for key, value in (("score", args.score), ("feedback", feedback),
                       ("metadata", args.metadata), ("report_id", args.report_id)):
        if value is not None:
            body[key] = value
    report = client.call("POST", "/reef/report", body=body, headers={"x-reef-scenario": scenario})
    if args.output == "json":
        print_json(report)
    else:
        print(f"report/{report.get('report_id')}" + ("" if args.output == "name" else " created"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Connection flags go on the root and on every subcommand, so they work before or after the verb."""
    from reefd.cli import (  # noqa: F401  (their verbs, after these)
        export_verbs,
        job_verbs,
        release_verbs,
        token_verbs,
        user_verbs,
    )

    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--url", default=argparse.SUPPRESS, help=f"reefd's address (env REEF_URL; {DEFAULT_URL})")
    conn.add_argument("--token", default=argparse.SUPPRESS,
                      help="bearer token (env REEF_TOKEN, first of a comma list; else STATE/token)")
    parser = argparse.ArgumentParser(
        prog="reefctl", parents=[conn], description="Talk to a running reefd over its admin API.",
        epilog="STATE is $REEF_STATE, else $STATE_DIRECTORY, else ~/.local/state/reefd.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, configure, run) in COMMANDS.items():
        p = sub.add_parser(name, parents=[conn], help=summary, description=summary)
        configure(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one reefctl command; the exit status is 0, 1 on any failure, or 2 (from argparse) on misuse."""
    args = build_parser().parse_args(argv)
    try:
        client = Client(*resolve_connection(args, os.environ))
        return int(args.run(client, args))
    except CliError as exc:
        print(f"reefctl: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `reefctl records x -o json | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

