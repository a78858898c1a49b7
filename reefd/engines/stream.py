"""Holds back streamed text that may turn out to be a stop string or tool-call markup.

A client must never see a stop sequence or a half-written `<tool_call>` in its text deltas.
Knows nothing about engines or wire formats.
"""

from __future__ import annotations

from collections.abc import Sequence

from reefd.serve.chat import TOOL_OPEN


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still grow into a stop string (the worker's detokenizer
    holds back by the same rule)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class StreamGuard:
    def __init__(self, stops: list[str], *, hold_tool_markup: bool):
        self._stops = [s for s in stops if s]
        self._markers = self._stops + ([TOOL_OPEN] if hold_tool_markup else [])
        self._held = ""
        self._closed = False
        self._emitted: list[str] = []  # pieces, not one growing string: a long answer costs linear time

    def feed(self, delta: str) -> str:
        """The part of `delta` (plus held text) that is safe to show now."""
        if self._closed:
            return ""
        text = self._held + delta
        cut = min((i for i in (text.find(m) for m in self._markers) if i >= 0), default=-1)
        if cut >= 0:
            self._closed = True
            self._held = ""
            return self._emit(text[:cut])
        keep = held_back(text, self._markers)
        self._held = text[len(text) - keep:] if keep else ""
        return self._emit(text[: len(text) - keep])

    @property
    def emitted(self) -> str:
        return "".join(self._emitted)

    def tail(self, final_text: str) -> str:
        """What is still owed once the final text is known (held text that was harmless)."""
        emitted = self.emitted
        if final_text.startswith(emitted):
            return self._emit(final_text[len(emitted):])
        return ""

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
