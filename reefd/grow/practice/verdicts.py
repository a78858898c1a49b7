"""What one verification said: the Verdict (the score, the verifier's own failure, what it said of the answer),
and how a verifier's text is kept as data. Every verifier form gives one; knows nothing about sandboxes, commands
or code tasks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TAIL = 2000  # characters of stdout and stderr kept in a verdict
FEEDBACK = 1000  # characters of what a verifier said kept as its report's feedback


@dataclass(frozen=True)
class Verdict:
    """One verification: the score (0 unless the verifier ran and accepted the answer), whether the verifier
    itself failed and why, and what it said (kept in the practice report's metadata). `said` is what a verifier
    that speaks for itself (the code verifier) says of the answer; a command's is what it printed."""

    score: float
    error: str | None
    output: dict[str, Any]
    said: str | None = None

    @property
    def feedback(self) -> str:
        """What the verifier said about the answer: `said`, else its stdout without the verdict line, at most
        FEEDBACK chars (empty when it failed, or said nothing else)."""
        if self.error is not None:
            return ""
        if self.said is not None:
            return self.said[:FEEDBACK]
        lines = str(self.output.get("stdout") or "").strip().splitlines()
        if lines and lines[-1].strip().startswith("{"):
            lines = lines[:-1]
        return "\n".join(lines).strip()[-FEEDBACK:]

    @property
    def passed(self) -> bool:
        return self.error is None and self.score > 0


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with its control characters (terminal escapes included; tabs and newlines kept) written as \\xNN:
    what a verifier prints is stored, shown and logged as data, never as a terminal's instructions."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
