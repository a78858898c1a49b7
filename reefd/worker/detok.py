"""Output text of one sequence: incremental decoding, stop-string matching, what is safe to stream.

Owns how `text` relates to `output_ids` (SGLang's rules: a matched stop string and all
after it are trimmed; a matched stop token's text is not shown). Knows nothing about torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from reefd.engines.stream import held_back  # torch-free: the stop-string rule streams are held back by

Decode = Callable[[Sequence[int]], str]


class TextTracker:
    """Decodes a growing id list piece by piece and watches it for stop strings.

    Each update decodes only the new ids, with the previous piece's ids before them as context
    (a tokenizer may render a token differently at the start of a text, and a character may
    span tokens), so the cost per token does not grow with the answer. A piece that ends in a
    half character waits for the next id. The pieces concatenate to the full decode.
    """

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._checked = 0  # text length already searched for stops
        self._prefix = 0  # ids[_prefix:_read]: the last decoded piece, context for the next one
        self._read = 0  # ids decoded into `text`
        self._taken = 0  # characters handed out by take()
        self.text = ""

    def update(self, ids: Sequence[int], check_stops: bool = True, final: bool = False) -> str | None:
        """Decode what `ids` (the whole answer so far) adds; return the stop string the text now
        contains (earliest match), if any. `final` also decodes a trailing half character."""
        if len(ids) > self._read:
            before = self.decode(ids[self._prefix : self._read])
            after = self.decode(ids[self._prefix :])
            if final or (len(after) > len(before) and not after.endswith("\ufffd")):
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, len(ids)
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

    def take(self) -> str:
        """The text that became safe to stream since the last call: no partial stop string, no
        half UTF-8 character."""
        text = self.text
        keep = len(text) - held_back(text, self.stops)
        while keep > self._taken and text[keep - 1] == "\ufffd":
            keep -= 1
        new = text[self._taken : keep] if keep > self._taken else ""
        self._taken += len(new)
        return new

    def rest(self) -> str:
        """Everything not yet taken: the end of a finished answer."""
        new = self.text[self._taken :]
        self._taken = len(self.text)
        return new
