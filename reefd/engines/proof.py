"""The release proof, engine side: what a process must answer on a release's probe set (its Fingerprint), and how
an answer is judged. A fingerprint comes from a reference outside the engines (reefd/train/fingerprint.py); each
engine process that loads or swaps to a release answers the same prompts greedily, one generate per prompt, before
the router or the scenario's binding sends it traffic (reefd/engines/sglang_base.py `_prove`).

The rule: every generated token is the reference's, and its logprob is within `tolerance` of the reference's. A
token may be the reference's runner-up only where the two were within 2 x `tolerance` of each other (a near-tie
that rounding decides), with the runner-up's logprob; the rest of that prompt is then not compared (it continues
from another token). Knows nothing of releases or scenarios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from reefd.engines import EngineError

DEFAULT_TOLERANCE = 0.05  # nats per token: see docs/releases.md, "Proof before serving"
PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog, and then the dog",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
               "Question: What is twelve times seven?\nAnswer:")
KEYS = ("prompts", "tokens", "logprobs", "second", "margins")


class ProofFailed(EngineError):
    """A process did not answer its release's probe set as the fingerprint says: it must not serve the release."""

    code = "release_proof_failed"


@dataclass(frozen=True)
class Fingerprint:
    """A release's answers on its probe set: per prompt, its token ids, and per generated token the reference's
    id, logprob, runner-up id and margin over it."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    second: list[list[int]]
    margins: list[list[float]]
    tolerance: float = DEFAULT_TOLERANCE

    @classmethod
    def from_json(cls, doc: Any) -> Fingerprint | None:
        """A fingerprint as a release or the reference wrote it (None: missing or malformed)."""
        if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in KEYS):
            return None
        n = len(doc["prompts"])
        if n == 0 or any(len(doc[k]) != n for k in KEYS):
            return None
        try:
            ints = {k: [[int(v) for v in row] for row in doc[k]] for k in ("prompts", "tokens", "second")}
            floats = {k: [[float(v) for v in row] for row in doc[k]] for k in ("logprobs", "margins")}
        except (TypeError, ValueError):
            return None
        fp = cls(ints["prompts"], ints["tokens"], floats["logprobs"], ints["second"], floats["margins"])
        ok = all(len(fp.tokens[i]) == len(fp.logprobs[i]) == len(fp.second[i]) == len(fp.margins[i]) > 0
                 for i in range(n)) and all(math.isfinite(v) for row in fp.logprobs + fp.margins for v in row)
        return fp if ok else None

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in KEYS}

    def within(self, tolerance: float) -> Fingerprint:
        return replace(self, tolerance=tolerance)

    def mismatch(self, answers: list[tuple[list[int], list[float]]]) -> str | None:
        """What differs between the answers (token ids and logprobs, per prompt) and the fingerprint; None: none."""
        for i, (ids, lps) in enumerate(answers):
            for j, want in enumerate(self.tokens[i]):
                if j >= len(ids) or j >= len(lps):
                    return f"prompt {i}: {len(ids)} tokens where the release answers {len(self.tokens[i])}"
                if ids[j] == want:
                    expected = self.logprobs[i][j]
                elif ids[j] == self.second[i][j] and self.margins[i][j] <= 2 * self.tolerance:
                    expected = self.logprobs[i][j] - self.margins[i][j]  # a near-tie, decided the other way
                else:
                    return f"prompt {i}, token {j}: {ids[j]} where the release answers {want}"
                if not abs(lps[j] - expected) <= self.tolerance:
                    return (f"prompt {i}, token {j}: logprob {lps[j]:.4f} where the release has {expected:.4f} "
                            f"(tolerance {self.tolerance:g})")
                if ids[j] != want:
                    break  # the continuation follows another token: not comparable
        return None
