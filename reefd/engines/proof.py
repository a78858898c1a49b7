"""The release proof, engine side: what a process must answer on a release's probe set (its Fingerprint), and how
an answer is judged. A fingerprint comes from a reference outside the engines (reefd/train/fingerprint.py); each
engine process that loads or swaps to a release is asked it before the router or the scenario's binding sends it
traffic (reefd/engines/sglang_base.py `_prove`): one teacher-forced pass per probe prompt, the prompt followed by
the reference's tokens, scored at every position of them (SGLangClient.teacher_forced). Nothing is decoded.

The rule, at every position of every prompt: the process's logprob of the reference's token is within `tolerance`
of the reference's, and its own best token is the reference's. Its best token may be the reference's runner-up
only where the reference's margin over it was within 2 x `tolerance` (a near-tie that rounding decides), with the
runner-up's logprob within `tolerance` of the reference's. Every position is compared: the context is the
reference's, so a near-tie decided the other way changes nothing after it. Knows nothing of releases or scenarios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from reefd.engines import EngineError

DEFAULT_TOLERANCE = 0.05  # nats per token: see docs/releases.md, "Proof before serving"
SLACK = 1e-9  # a difference at the tolerance itself passes, however float rounding leaves it
PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog, and then the dog",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
               "Question: What is twelve times seven?\nAnswer:")
KEYS = ("prompts", "tokens", "logprobs", "second", "margins")


class ProofFailed(EngineError):
    """A process did not answer its release's probe set as the fingerprint says: it must not serve the release."""

    code = "release_proof_failed"


@dataclass(frozen=True)
class Scored:
    """A process's teacher-forced answer to one probe prompt, at each position of the reference's tokens: the
    logprob it gives the reference's token (None: it did not report one), and its own best token and that token's
    logprob."""

    logprobs: list[float | None]
    best: list[int]
    best_logprobs: list[float]


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
                 and len(fp.prompts[i]) > 0 for i in range(n)) and \
            all(math.isfinite(v) for row in fp.logprobs + fp.margins for v in row)
        return fp if ok else None

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in KEYS}

    def within(self, tolerance: float) -> Fingerprint:
        return replace(self, tolerance=tolerance)

    def mismatch(self, answers: list[Scored]) -> str | None:
        """What differs between a process's teacher-forced answers (one per prompt) and the fingerprint; None:
        nothing does."""
        for i, answer in enumerate(answers):
            n = len(self.tokens[i])
            if not len(answer.logprobs) == len(answer.best) == len(answer.best_logprobs) == n:
                return f"prompt {i}: {len(answer.logprobs)} positions scored where the release has {n}"
            for j in range(n):
                problem = self._position(i, j, answer)
                if problem is not None:
                    return f"prompt {i}, token {j}: {problem}"
        return None

    def _position(self, i: int, j: int, answer: Scored) -> str | None:
        tol, want, got = self.tolerance, self.tokens[i][j], answer.logprobs[j]
        if got is None:  # vLLM reports a position's best tokens only
            return (f"the release's token {want} (logprob {self.logprobs[i][j]:.4f}) is not among the best the "
                    f"process reported (its best is {answer.best[j]}, logprob {answer.best_logprobs[j]:.4f})")
        if not abs(got - self.logprobs[i][j]) <= tol + SLACK:
            return (f"logprob {got:.4f} for the release's token {want} where the release has "
                    f"{self.logprobs[i][j]:.4f} (tolerance {tol:g})")
        best = answer.best[j]
        if best == want:
            return None
        margin = self.margins[i][j]
        if best != self.second[i][j] or margin > 2 * tol + SLACK:
            return (f"the best token is {best} where the release's is {want} (its runner-up {self.second[i][j]}, "
                    f"{margin:.4f} behind; a near-tie is within {2 * tol:g})")
        expected = self.logprobs[i][j] - margin  # a near-tie, decided the other way: the runner-up's logprob
        if not abs(answer.best_logprobs[j] - expected) <= tol + SLACK:
            return (f"the runner-up {best} is best with logprob {answer.best_logprobs[j]:.4f} where the release "
                    f"gives it {expected:.4f} (tolerance {tol:g})")
        return None
