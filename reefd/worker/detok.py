"""Output text of one sequence: cumulative decoding, stop-string matching, safe streaming prefix.

Owns how `text` relates to `output_ids` (SGLang's rules: a matched stop string and all
after it are trimmed; a matched stop token's text is not shown). Knows nothing about torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still grow into a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextTracker:
    """Decodes a growing id list and watches it for stop strings."""

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._checked = 0  # text length already searched for stops
        self.text = ""

    def update(self, ids: Sequence[int], check_stops: bool = True) -> str | None:
        """Decode `ids`; return the stop string it now contains (earliest match), if any."""
        self.text = self.decode(ids)
        if not self.stops or not check_stops:
            return None
        start = max(0, self._checked - self._longest + 1)
        self._checked = len(self.text)
        hits = [(pos, s) for s in self.stops if (pos := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = self.text[:pos]
        return stop

    def visible(self) -> str:
        """The prefix safe to stream now: no partial stop string, no half UTF-8 character."""
        text = self.text
        keep = len(text) - held_back(text, self.stops)
        text = text[:keep]
        return text.rstrip("\ufffd")
