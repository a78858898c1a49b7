"""reefctl export: a scenario's records with their reports, as JSON lines, as a Parquet file or as Tinker `Datum`s.

Standard library only, except pyarrow for `--format parquet`, imported then and only then (the `export` extra).
The daemon streams JSON lines (reefd/api/export.py); Parquet is made here, a row group at a time, with one flat
schema (PARQUET_COLUMNS) that `datasets.load_dataset("parquet", data_files=...)` reads as it is; so are the datums,
in the JSON shape of the `tinker` SDK's `Datum` (without the SDK: its shape, written out in `datum_line`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from reefd.cli.client import Client, CliError
from reefd.cli.kit import command, note

INSTALL_HINT = "pip install 'reefd[export]'"
ROW_GROUP = 1000  # rows held in memory before they are written to the Parquet file

# One row per record. Scalars as they are; what varies in shape (messages, reports, tags, the provider's request and
# response) as JSON text. Columns are only ever added, never renamed or retyped.
PARQUET_COLUMNS: tuple[tuple[str, str], ...] = (
    ("receipt", "string"),
    ("scenario", "string"),
    ("created_at", "float64"),  # seconds since the epoch
    ("api", "string"),
    ("model", "string"),
    ("release", "string"),  # the release that served it
    ("adapter", "string"),
    ("engine", "string"),
    ("session", "string"),
    ("turn", "int64"),
    ("previous", "string"),  # the receipt of the session's turn before it
    ("next", "string"),  # ... and after it
    ("prompt", "string"),  # JSON: the messages the model was given
    ("completion", "string"),  # the answer's text
    ("finish_reason", "string"),
    ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"),
    ("latency_s", "float64"),
    ("prompt_token_ids", "list<int64>"),  # as the engine consumed and produced them
    ("completion_token_ids", "list<int64>"),
    ("completion_logprobs", "list<float64>"),
    ("score", "float64"),  # the newest report's score
    ("feedback", "string"),  # the newest report's feedback (JSON when it is not text)
    ("reports", "string"),  # JSON: every report, oldest first
    ("tags", "string"),  # JSON
    ("request", "string"),  # JSON: the provider request as sent
    ("response", "string"),  # JSON: the provider response as answered
)


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else _json(value)


def _number(value: Any, kind: type) -> Any:
    return kind(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _numbers(value: Any, kind: type) -> list[Any] | None:
    if not isinstance(value, list):
        return None
    return [_number(v, kind) for v in value]


def _latest(reports: list[Mapping[str, Any]], key: str) -> Any:
    """The newest report's value of `key` among those that have one."""
    found = [r for r in reports if r.get(key) is not None and not (key == "score" and isinstance(r[key], bool))]
    return max(found, key=lambda r: r.get("created_at") or 0)[key] if found else None


def flat_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record (with its reports) as one row of PARQUET_COLUMNS."""
    raw_messages, raw_usage = record.get("messages"), record.get("usage")
    messages: list[Any] = raw_messages if isinstance(raw_messages, list) else []
    last = messages[-1] if messages else None
    reply: dict[str, Any] | None = None  # the answer, appended to the messages once it was made
    if isinstance(last, dict) and last.get("role") == "assistant" and "response" in record:
        reply = last
    reports: list[Mapping[str, Any]] = [r for r in record.get("reports") or [] if isinstance(r, dict)]
    usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    return {
        "receipt": record.get("id"), "scenario": record.get("scenario"),
        "created_at": _number(record.get("created_at"), float),
        **{k: _text(record.get(k)) for k in ("api", "model", "release", "adapter", "engine", "session", "previous",
                                             "next", "finish_reason")},
        "turn": _number(record.get("turn"), int),
        "prompt": _json(messages[:-1] if reply is not None else messages),
        "completion": _text(reply.get("content")) if reply is not None else None,
        "prompt_tokens": _number(usage.get("prompt_tokens"), int),
        "completion_tokens": _number(usage.get("completion_tokens"), int),
        "latency_s": _number(record.get("latency_s"), float),
        "prompt_token_ids": _numbers(record.get("prompt_token_ids"), int),
        "completion_token_ids": _numbers(record.get("completion_token_ids"), int),
        "completion_logprobs": _numbers(record.get("completion_logprobs"), float),
        "score": _number(_latest(reports, "score"), float),
        "feedback": _text(_latest(reports, "feedback")),
        "reports": _json(reports),
        "tags": _json(record.get("tags")),
        "request": _json(record.get("request")),
        "response": _json(record.get("response")),
    }


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise CliError(f"--format parquet needs pyarrow, which is not installed: {INSTALL_HINT}") from None
    return pyarrow


def parquet_schema(pa: Any) -> Any:
    types = {"string": pa.string(), "float64": pa.float64(), "int64": pa.int64(),
             "list<int64>": pa.list_(pa.int64()), "list<float64>": pa.list_(pa.float64())}
    return pa.schema([(name, types[kind]) for name, kind in PARQUET_COLUMNS])


def write_parquet(records: Iterator[Mapping[str, Any]], out: IO[bytes]) -> int:
    """Write the records to `out` as Parquet, ROW_GROUP rows at a time; returns how many."""
    pa = _pyarrow()
    schema = parquet_schema(pa)
    count, rows = 0, []
    records = iter(records)
    first = next(records, None)  # the request is answered (or refused) before the file's first byte
    with pa.parquet.ParquetWriter(out, schema) as writer:
        for record in itertools.chain([] if first is None else [first], records):
            rows.append(flat_row(record))
            if len(rows) >= ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                count, rows = count + len(rows), []
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))  # an export of nothing still has the schema
    return count + len(rows)


def _token_ids(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    return value


def _tensor(data: list[Any], dtype: str) -> dict[str, Any]:
    """A `tinker.types.TensorData`, one-dimensional."""
    return {"data": data, "dtype": dtype, "shape": [len(data)]}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def datum_line(record: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """A record as one `--format datums` line, or None and why it has none.

    The datum is next-token prediction over prompt + completion, shifted by one: `model_input` all but the last
    token, `target_tokens` all but the first; `weights` 0 where the target is the prompt's, 1 where it is the
    completion's; `logprobs` (the record's own) and `advantages` (the newest report's score) on the completion's
    targets, 0 on the prompt's, when the record has them.
    """
    prompt = _token_ids(record.get("prompt_token_ids"))
    completion = _token_ids(record.get("completion_token_ids"))
    if prompt is None or completion is None:
        return None, "without token ids"
    tokens = prompt + completion
    if not completion or len(tokens) < 2:
        return None, "without a completion token to predict"
    zeros = max(len(prompt) - 1, 0)  # targets that are the prompt's
    ones = len(tokens) - 1 - zeros  # ... and the completion's: all of it (all but its first, without a prompt)
    inputs: dict[str, Any] = {"target_tokens": _tensor(tokens[1:], "int64"),
                              "weights": _tensor([0.0] * zeros + [1.0] * ones, "float32")}
    logprobs = record.get("completion_logprobs")
    if isinstance(logprobs, list) and len(logprobs) == len(completion) and all(_finite(v) for v in logprobs):
        inputs["logprobs"] = _tensor([0.0] * zeros + [float(v) for v in logprobs[len(completion) - ones:]],
                                     "float32")
    reports: list[Mapping[str, Any]] = [r for r in record.get("reports") or [] if isinstance(r, dict)]
    newest = _latest(reports, "score")
    score = float(newest) if _finite(newest) else None
    if score is not None:
        inputs["advantages"] = _tensor([0.0] * zeros + [score] * ones, "float32")
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]}, "loss_fn_inputs": inputs}
    return {"datum": datum, "receipt": record.get("id"), "scenario": record.get("scenario"),
            "turn_kind": record.get("turn_kind"), "release": record.get("release"), "score": score}, ""


def write_datums(records: Iterator[Mapping[str, Any]], out: IO[bytes]) -> tuple[int, Counter[str]]:
    """Write a `datum_line` per record that has one; returns how many, and how many were skipped for each reason."""
    count, skipped = 0, Counter[str]()
    for record in records:
        line, why = datum_line(record)
        if line is None:
            skipped[why] += 1
            continue
        out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        count += 1
    return count, skipped


@contextlib.contextmanager
def _destination(path: str | None) -> Iterator[IO[bytes]]:
    """stdout, or FILE written beside it as FILE.part and renamed once complete (never a half export as FILE)."""
    if path is None or path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(path)
    part = target.with_name(target.name + ".part")
    try:
        with part.open("wb") as out:
            yield out
        os.replace(part, target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="SCENARIO")
    p.add_argument("--format", choices=["jsonl", "parquet", "datums"], default="jsonl",
                   help="jsonl (default): one record per line, as `get record` shows it; parquet: one flat row per "
                        f"record (needs {INSTALL_HINT}); datums: one Tinker Datum per record with token ids, as "
                        '{"datum": ..., "receipt": ..., "score": ...}')
    p.add_argument("--since", metavar="R",
                   help="only records after a receipt, since a release was published (r3-1a2b3c4), from a recent "
                        "duration (90s, 30m, 24h, 7d) or from a time (2025-01-31T00:00:00Z)")
    p.add_argument("--reported-only", action="store_true", help="only records that have a report")
    p.add_argument("--practice", choices=["include", "exclude", "only"], default="include",
                   help="reefd's own practice records: include (default), exclude or only them")
    p.add_argument("-o", "--out", metavar="FILE", help="write to FILE instead of stdout (required for parquet "
                                                       "on a terminal)")


def _query(args: argparse.Namespace) -> dict[str, str]:
    query: dict[str, str] = {}
    if args.since:
        query["since"] = args.since
    if args.reported_only:
        query["reported_only"] = "true"
    if args.practice != "include":
        query["practice"] = args.practice
    return query


@command("export", "write a scenario's records with their reports as JSON lines, Parquet or Tinker Datums",
         _export_args)
def cmd_export(client: Client, args: argparse.Namespace) -> int:
    if args.format == "parquet":
        _pyarrow()  # before anything is asked of reefd
        if args.out in (None, "-") and sys.stdout.isatty():
            raise CliError("--format parquet writes binary: give -o FILE (or redirect stdout)")
    lines = client.lines(f"/reef/scenarios/{urllib.parse.quote(args.name, safe='')}/export", query=_query(args))
    skipped: Counter[str] = Counter()
    with _destination(args.out) as out:
        if args.format == "parquet":
            count = write_parquet((json.loads(line) for line in lines if line.strip()), out)
        elif args.format == "datums":
            count, skipped = write_datums((json.loads(line) for line in lines if line.strip()), out)
        else:
            count = 0
            for line in lines:
                out.write(line)
                count += 1
    if skipped:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        note(f"skipped {skipped.total()} records of {args.name}: {why}")
    if args.out not in (None, "-"):
        note(f"exported {count} {'datums' if args.format == 'datums' else 'records'} of {args.name} to {args.out}")
    return 0
