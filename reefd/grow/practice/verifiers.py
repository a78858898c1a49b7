"""Verifiers: what decides whether a practice answer is right. A verifier is a command or a Python function
`pkg.mod:fn(answer, task)`, and either runs in the sandbox (reefd/grow/practice/sandbox.py), the answer in
`answer.txt` and on stdin, the task in `task.json`; or it is `code: python`, where the answer is code run against
the task's tests in a sandbox that holds neither (code_tasks.py). A verifier that crashes, hangs or prints garbage
gives a failed verification with the reason, never an exception. Knows nothing about records, engines or schedules.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd import plugins
from reefd.grow.practice import sandbox
from reefd.grow.practice.code_tasks import LANGUAGES, CodeVerifier
from reefd.grow.practice.sandbox import Limits, Outcome
from reefd.grow.practice.verdicts import TAIL, Verdict, printable

PACKAGE = Path(__file__).resolve().parents[2]  # reefd itself: a function verifier's runner imports it
ROOT = PACKAGE.parent  # where reefd imports from, inside the sandbox too (which holds only PACKAGE of it)
PASSED, FAILED = 0, 1  # exit statuses with a meaning (as pytest's); any other is the verifier's own failure


class VerifierError(ValueError):
    """A verifier config that cannot work; str() is one line."""


@dataclass
class VerifierConfig:
    """How a scenario's practice answers are verified: exactly one of `command`, `function` and `code`, and the
    limits."""

    command: Any = field(default=None, metadata={
        "description": "A command: a string run by sh, or a list run as it is, in a scratch folder holding "
                       "answer.txt and task.json (the answer also on stdin; $REEF_SCENARIOS is the scenarios "
                       "folder's path, where only what `read` lists is seen). Exit 0: right; exit 1: wrong; else "
                       "(or a last stdout line that is a JSON object whose `score` is not a number in [0, 1]) the "
                       "verifier failed. A last line {\"score\": x} gives a partial score."})
    function: str | None = field(default=None, metadata={
        "description": "A Python function pkg.mod:fn(answer: str, task: dict) -> bool or a score in [0, 1], "
                       "imported from the scenarios folder (its module or package is seen by the sandbox) or the "
                       "installed packages, run in the same sandbox."})
    code: str | None = field(default=None, metadata={
        "enum": [None, *LANGUAGES],
        "description": "python: each task line has `entry` (the function to write) and `tests` (a list of "
                       "{\"args\": [...], \"kwargs\": {...}, \"expected\": ...}); the answer's code (its first "
                       "```python block, else its first untagged one, else all of it) runs with the standard "
                       "library in a sandbox of its own that holds neither the task nor an expected value, and its "
                       "score is the share of tests whose result reefd finds equal to `expected`."})
    read: list[str] = field(default_factory=list, metadata={
        "description": "Files and folders the verifier may read (read-only, at their own paths): relative to the "
                       "scenarios folder, or absolute. Nothing else of the host is seen but the system's "
                       "libraries and interpreters, Python's prefix and reefd's own package."})
    timeout_s: float = field(default=10.0, metadata={"exclusiveMinimum": 0, "maximum": 3600,
                                                     "description": "Wall-clock limit of one verification."})
    memory_mb: int = field(default=512, metadata={"minimum": 16, "maximum": 1 << 20,
                                                  "description": "Address space of each of its processes."})
    processes: int = field(default=64, metadata={"minimum": 1, "maximum": 4096,
                                                 "description": "Processes and threads at once."})
    disk_mb: int = field(default=256, metadata={"minimum": 1, "maximum": 1 << 20, "description":
                                                "What it may write in each of its scratch folder, /tmp and "
                                                "/dev/shm (each a tmpfs of this size, in memory)."})


class Verifier:
    """One scenario's verifier, checked when its scenario loads."""

    def __init__(self, cfg: VerifierConfig, scenarios_dir: Path, hide: tuple[Path, ...] = ()) -> None:
        self.cfg, self.scenarios_dir, self.hide = cfg, scenarios_dir.resolve(), hide
        if [cfg.command, cfg.function, cfg.code].count(None) != 2:
            raise VerifierError("practice.verifier: set exactly one of command, function and code")
        if cfg.code is not None and cfg.read:
            raise VerifierError("practice.verifier.read: a code verifier's sandbox holds the answer's code alone")
        if cfg.code is not None:
            if cfg.code not in LANGUAGES:
                raise VerifierError(f"practice.verifier.code: {cfg.code!r} is not one of {', '.join(LANGUAGES)}")
            self.argv: list[str] = []
        elif cfg.function is not None:
            if not plugins.is_dotted(cfg.function):
                raise VerifierError(f"practice.verifier.function: {cfg.function!r} is not pkg.mod:fn")
            self.argv = [sys.executable, "-m", "reefd.grow.practice.call", cfg.function]
        elif isinstance(cfg.command, str) and cfg.command.strip():
            self.argv = ["/bin/sh", "-c", cfg.command]
        elif isinstance(cfg.command, list) and cfg.command and all(isinstance(a, str) for a in cfg.command):
            self.argv = list(cfg.command)
        else:
            raise VerifierError("practice.verifier.command: a non-empty string or list of strings")
        self.expose = self._expose(cfg)
        self.limits = Limits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, processes=cfg.processes,
                             disk_mb=cfg.disk_mb)
        # the scenarios folder holds the code tasks' expected values: hidden, whatever the sandbox's root holds
        self.code = None if cfg.code is None else CodeVerifier(self.limits, (*hide, self.scenarios_dir))

    def _expose(self, cfg: VerifierConfig) -> tuple[Path, ...]:
        """What the sandbox sees besides the system: Python's prefixes, reefd's package, the function's own module
        where it lies in the scenarios folder, and `read`'s paths (each must exist, outside reefd's state)."""
        seen = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), PACKAGE]
        if cfg.function is not None:
            top = cfg.function.split(":")[0].split(".")[0]
            seen += [p for p in (self.scenarios_dir / top, self.scenarios_dir / f"{top}.py") if p.exists()]
        for i, listed in enumerate(cfg.read):
            path = (self.scenarios_dir / listed).resolve() if isinstance(listed, str) and listed else None
            if path is None or not path.exists():
                raise VerifierError(f"practice.verifier.read[{i}]: {listed!r} is not a file or folder "
                                    f"(relative to {self.scenarios_dir}, or absolute)")
            if any(path.is_relative_to(h.absolute()) for h in self.hide):  # hidden in the sandbox whatever it lists
                raise VerifierError(f"practice.verifier.read[{i}]: {listed!r} is in reefd's state folder")
            seen.append(path)
        return tuple(seen)

    def describe(self) -> str:
        """The verifier in one line, for status."""
        if self.cfg.code is not None:
            return f"code: {self.cfg.code}"
        return self.cfg.function or (self.cfg.command if isinstance(self.cfg.command, str)
                                     else shlex.join(self.argv))

    async def verify(self, answer: str, task: dict[str, Any]) -> Verdict:
        if self.code is not None:
            return await self.code.verify(answer, task)
        env = {"REEF_SCENARIOS": str(self.scenarios_dir), "REEF_ANSWER": "answer.txt", "REEF_TASK": "task.json",
               "PYTHONPATH": f"{self.scenarios_dir}:{ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
        data = answer.encode()
        outcome = await sandbox.run(self.argv, limits=self.limits, stdin=data, hide=self.hide, env=env,
                                    expose=self.expose,
                                    files={"answer.txt": data, "task.json": json.dumps(task).encode()})
        return judge(outcome)


def judge(outcome: Outcome) -> Verdict:
    """The verdict an outcome gives, by the exit status and the last line of stdout."""
    stdout = printable(outcome.stdout)
    output = {"returncode": outcome.returncode, "seconds": round(outcome.seconds, 4),
              "stdout": stdout[-TAIL:], "stderr": printable(outcome.stderr)[-TAIL:]}
    if outcome.returncode not in (PASSED, FAILED):
        failure = outcome.failure
        return Verdict(0.0, printable(failure) if failure is not None else None, output)
    if outcome.returncode == FAILED and outcome.stderr.startswith("bwrap: "):  # bwrap's own exit 1: not "wrong"
        return Verdict(0.0, f"the sandbox did not start: {printable(outcome.stderr.strip())[:300]}", output)
    lines = stdout.strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if not last.startswith("{"):
        return Verdict(1.0 if outcome.returncode == PASSED else 0.0, None, output)
    try:
        score = json.loads(last)["score"]
        ok = isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok or not 0 <= score <= 1:
        return Verdict(0.0, f"a verdict line that is not {{\"score\": a number in [0, 1]}}: {last[:200]}", output)
    return Verdict(float(score) if outcome.returncode == PASSED else 0.0, None, output)
