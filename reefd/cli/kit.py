"""Pieces every reefctl verb shares: the verb registry, kubectl-style tables and cells, argument types.

Standard library only (reefctl must start fast).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from reefd.cli.client import Client


def print_json(obj: Any, *, lines: bool = False) -> None:
    print(json.dumps(obj, ensure_ascii=False, indent=None if lines else 2), flush=True)


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Table:
    """kubectl-style columns: left-aligned, three spaces apart, header before the first row.
    Widths only grow, so rows printed later (--follow) stay aligned as far as they can."""

    def __init__(self, headers: Sequence[str]) -> None:
        self.headers = list(headers)
        self.widths = [len(h) for h in headers]
        self.started = False

    def emit(self, rows: Sequence[Sequence[str]]) -> None:
        if not rows:
            return
        for row in rows:
            self.widths = [max(w, len(cell)) for w, cell in zip(self.widths, row, strict=True)]
        for row in ([] if self.started else [self.headers]) + [list(r) for r in rows]:
            print("   ".join(cell.ljust(w) for cell, w in zip(row, self.widths, strict=True)).rstrip(), flush=True)
        self.started = True


def age(seconds: float | None) -> str:
    """kubectl-style: 42s, 5m3s, 2h7m, 3d4h."""
    s = int(seconds or 0)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d}d{h}h" if d else f"{h}h{m}m" if h else f"{m}m{s % 60}s" if m else f"{s}s"


def cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def printable(text: str) -> str:
    """No escape codes into the terminal: each control character becomes `?`."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


Run = Callable[[Client, argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
COMMANDS: dict[str, tuple[str, Configure, Run]] = {}  # verb -> (help, declare its arguments, run it)


def command(name: str, help: str, configure: Configure) -> Callable[[Run], Run]:
    """Register `reefctl NAME`; a new verb is one decorated function plus its arguments."""

    def register(run: Run) -> Run:
        COMMANDS[name] = (help, configure, run)
        return run

    return register


def number(kind: Callable[[str], float], *, positive: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite number, and above zero when `positive` (so nan, inf and 0 are usage errors)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or (positive and value <= 0):
            raise argparse.ArgumentTypeError(f"must be a finite{' positive' if positive else ''} number: {text!r}")
        return value

    return parse


def json_arg(text: str, *, want: type = object) -> Any:
    """An argparse type: JSON text, of type `want` (dict for --metadata)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc}): {text!r}") from None
    if not isinstance(value, want):
        raise argparse.ArgumentTypeError(f"must be a JSON {'object' if want is dict else want.__name__}: {text!r}")
    return value
