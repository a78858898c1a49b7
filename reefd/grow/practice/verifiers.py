"""Verifiers: what decides whether a practice answer is right. A verifier is a command or a Python function
`pkg.mod:fn(answer, task)`, and either runs in the sandbox (reefd/grow/practice/sandbox.py), the answer in
`answer.txt` and on stdin, the task in `task.json`. A verifier that crashes, hangs or prints garbage gives a
failed verification with the reason, never an exception. Knows nothing about records, engines or schedules.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reefd import plugins
from reefd.grow.practice import sandbox
from reefd.grow.practice.sandbox import Limits, Outcome

ROOT = Path(__file__).resolve().parents[3]  # where reefd and recipes import from, inside the sandbox too
PASSED, FAILED = 0, 1  # exit statuses with a meaning (as pytest's); any other is the verifier's own failure
TAIL = 2000  # characters of stdout and stderr kept in a verdict
FEEDBACK = 1000  # characters of what a verifier printed kept as its report's feedback


class VerifierError(ValueError):
    """A verifier config that cannot work; str() is one line."""


@dataclass
class VerifierConfig:
    """How a scenario's practice answers are verified: exactly one of `command` and `function`, and the limits."""

    command: Any = field(default=None, metadata={
        "description": "A command: a string run by sh, or a list run as it is, in a scratch folder holding "
                       "answer.txt and task.json (the answer also on stdin; $REEF_SCENARIOS is the scenarios "
                       "folder). Exit 0: right; exit 1: wrong; else (or a last stdout line that is a JSON object "
                       "whose `score` is not a number in [0, 1]) the verifier failed. A last line "
                       "{\"score\": x} gives a partial score."})
    function: str | None = field(default=None, metadata={
        "description": "A Python function pkg.mod:fn(answer: str, task: dict) -> bool or a score in [0, 1], "
                       "imported from the scenarios folder or the installed packages, run in the same sandbox."})
    timeout_s: float = field(default=10.0, metadata={"exclusiveMinimum": 0, "maximum": 3600,
                                                     "description": "Wall-clock limit of one verification."})
    memory_mb: int = field(default=512, metadata={"minimum": 16, "maximum": 1 << 20,
                                                  "description": "Address space of each of its processes."})
    processes: int = field(default=64, metadata={"minimum": 1, "maximum": 4096,
                                                 "description": "Processes and threads at once."})
    disk_mb: int = field(default=256, metadata={"minimum": 1, "maximum": 1 << 20, "description":
                                                "What it may write in each of its scratch folder, /tmp and "
                                                "/dev/shm (each a tmpfs of this size, in memory)."})


@dataclass(frozen=True)
class Verdict:
    """One verification: the score (0 unless the verifier ran and accepted the answer), whether the verifier
    itself failed and why, and what it said (kept in the practice report's metadata)."""

    score: float
    error: str | None
    output: dict[str, Any]

    @property
    def feedback(self) -> str:
        """What the verifier printed about the answer: its stdout without the verdict line, at most FEEDBACK chars
        (empty when it failed, or said nothing else)."""
        if self.error is not None:
            return ""
        lines = str(self.output.get("stdout") or "").strip().splitlines()
        if lines and lines[-1].strip().startswith("{"):
            lines = lines[:-1]
        return "\n".join(lines).strip()[-FEEDBACK:]

    @property
    def passed(self) -> bool:
        return self.error is None and self.score > 0


class Verifier:
    """One scenario's verifier, checked when its scenario loads."""

    def __init__(self, cfg: VerifierConfig, scenarios_dir: Path, hide: tuple[Path, ...] = ()) -> None:
        self.cfg, self.scenarios_dir, self.hide = cfg, scenarios_dir.resolve(), hide
        if (cfg.command is None) == (cfg.function is None):
            raise VerifierError("practice.verifier: set exactly one of command and function")
        if cfg.function is not None:
            if not plugins.is_dotted(cfg.function):
                raise VerifierError(f"practice.verifier.function: {cfg.function!r} is not pkg.mod:fn")
            self.argv = [sys.executable, "-m", "reefd.grow.practice.call", cfg.function]
        elif isinstance(cfg.command, str) and cfg.command.strip():
            self.argv = ["/bin/sh", "-c", cfg.command]
        elif isinstance(cfg.command, list) and cfg.command and all(isinstance(a, str) for a in cfg.command):
            self.argv = list(cfg.command)
        else:
            raise VerifierError("practice.verifier.command: a non-empty string or list of strings")
        self.limits = Limits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, processes=cfg.processes,
                             disk_mb=cfg.disk_mb)

    def describe(self) -> str:
        """The verifier in one line, for status."""
        return self.cfg.function or (self.cfg.command if isinstance(self.cfg.command, str)
                                     else shlex.join(self.argv))

    async def verify(self, answer: str, task: dict[str, Any]) -> Verdict:
        env = {"REEF_SCENARIOS": str(self.scenarios_dir), "REEF_ANSWER": "answer.txt", "REEF_TASK": "task.json",
               "PYTHONPATH": f"{self.scenarios_dir}:{ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
        data = answer.encode()
        outcome = await sandbox.run(self.argv, limits=self.limits, stdin=data, hide=self.hide, env=env,
                                    expose=(self.scenarios_dir, ROOT, Path(sys.prefix)),
                                    files={"answer.txt": data, "task.json": json.dumps(task).encode()})
        return judge(outcome)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with its control characters (terminal escapes included; tabs and newlines kept) written as \\xNN:
    what a verifier prints is stored, shown and logged as data, never as a terminal's instructions."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


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
