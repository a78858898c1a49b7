"""A gate's tasks and scorers: the JSONL task file, the shipped and dotted-path scorers, and the fingerprint of
everything a side's per-task scores depend on besides its weights.

Knows nothing about gate kinds, engines or releases.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class GateError(ValueError):
    """A gate that cannot run: a missing or malformed tasks file, a bad scorer, a bad score."""


@dataclass(frozen=True)
class Task:
    """One held-out task: the chat messages sent, the expected answer, and the line it came from."""

    messages: list[dict[str, Any]]
    answer: Any
    raw: dict[str, Any]
    where: str = ""  # "path:line", for error messages


Scorer = Callable[[str, Task], float]
"""(answer text, task) -> a score in [0, 1]."""


@dataclass
class TaskConfig:
    """The keys of every gate kind that answers held-out tasks: the task file, the scorer and the sampling."""

    tasks: str | None = field(
        default=None,
        metadata={"description": "JSONL task file (relative to the scenarios folder): one object per line "
                                 "with `prompt` (a string or OpenAI messages) and `answer`."})
    scorer: str = field(
        default="exact",
        metadata={"description": "exact (answer == text, stripped), regex (answer is a pattern searched in "
                                 "the text), or a dotted path pkg.mod:fn(text, task) -> float in [0, 1]."})
    min_tasks: int = field(default=1, metadata={"minimum": 1, "maximum": 100_000,
                                                "description": "Fewer tasks: the gate fails."})
    max_tokens: int = field(default=32, metadata={"minimum": 1, "maximum": 32_768,
                                                  "description": "Answer length per task."})
    temperature: float = field(default=0.0, metadata={"minimum": 0, "maximum": 2,
                                                      "description": "Sampling for both sides (0: greedy)."})
    samples: int = field(default=1, metadata={"minimum": 1, "maximum": 1024,
                                              "description": "Answers per task and side."})
    seed: int = field(default=0, metadata={"minimum": 0, "maximum": 2**63 - 1,
                                           "description": "Sampling seed, the same for both sides."})

# ---------------------------------------------------------------- task files


def _messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise GateError(f"{where}: 'prompt' must be a string or a non-empty list of chat messages")
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise GateError(f"{where}: prompt[{i}] is not a chat message (an object with a string 'role')")
    return prompt


def load_tasks(path: Path) -> list[Task]:
    """Read a JSONL task file: one object per line with `prompt` and `answer`; blank lines are skipped."""
    return read_tasks(path)[0]


def read_tasks(path: Path, required: tuple[str, ...] = ("prompt", "answer")) -> tuple[list[Task], str]:
    """The tasks, and the sha256 of the very bytes they were parsed from; each line must have the `required`
    keys (a practice set's tasks need no `answer`: their verifier knows)."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise GateError(f"{path}: tasks file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GateError(f"{path}: cannot read tasks file: {exc}") from exc
    tasks = []
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit inside a string
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GateError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise GateError(f"{where}: a task is a JSON object, not {type(obj).__name__}")
        for key in required:
            if key not in obj:
                raise GateError(f"{where}: missing {key!r}")
        tasks.append(Task(messages=_messages(obj["prompt"], where), answer=obj.get("answer"), raw=obj, where=where))
    return tasks, hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- scorers


def _exact() -> Scorer:
    def exact(text: str, task: Task) -> float:
        return 1.0 if text.strip() == str(task.answer).strip() else 0.0

    return exact


def _regex() -> Scorer:
    compiled: dict[str, re.Pattern[str]] = {}  # one compile per pattern, however many samples

    def regex(text: str, task: Task) -> float:
        if not isinstance(task.answer, str):
            raise GateError(f"{task.where}: the regex scorer needs a string answer (a pattern)")
        pattern = compiled.get(task.answer)
        if pattern is None:
            try:
                pattern = compiled[task.answer] = re.compile(task.answer)
            except re.error as exc:
                raise GateError(f"{task.where}: bad regex {task.answer!r}: {exc}") from None
        return 1.0 if pattern.search(text) else 0.0

    return regex


SCORERS: dict[str, Callable[[], Scorer]] = {"exact": _exact, "regex": _regex}


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _import_scorer(spec: str) -> Scorer:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GateError(f"scorer {spec!r}: expected {', '.join(SCORERS)} or a dotted path pkg.mod:fn")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it loads
        raise GateError(f"scorer {spec!r}: cannot import {module_name}: {_one_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise GateError(f"scorer {spec!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise GateError(f"scorer {spec!r}: {type(obj).__name__} is not callable")
    fn: Scorer = obj
    return fn


def scorer(spec: str) -> Scorer:
    """The scorer named by `spec` (exact, regex or pkg.mod:fn), checking every score it returns.

    A score must be a finite number within [0, 1]; anything else, or an exception from a user's
    scorer, is a GateError naming the task.
    """
    factory = SCORERS.get(spec)
    inner = factory() if factory else _import_scorer(spec)

    def checked(text: str, task: Task) -> float:
        try:
            value = inner(text, task)
        except GateError:
            raise
        except Exception as exc:
            raise GateError(f"{task.where}: scorer {spec!r} failed: {_one_line(exc)}") from exc
        if not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise GateError(f"{task.where}: scorer {spec!r} returned {value!r}, not a number in [0, 1]")
        return float(value)

    return checked


def fingerprint(cfg: TaskConfig, scenarios_dir: Path, context: dict[str, Any] | None = None, *,
                tasks_sha256: str | None = None) -> str:
    """A digest of everything a side's per-task scores depend on except its weights: the tasks file's bytes
    (`tasks_sha256` when the caller already read them), the scorer (a dotted-path scorer's module source too),
    the sampling (max_tokens, temperature, samples, seed), reefd's version, and the caller's `context` (the
    model's settings, how prompts are sent). Two gates with one fingerprint ask the same questions with the
    same seeds, so on an engine that samples each request with its own seeded generator a release's scores
    from one stand for what the other would measure, up to batch-dependent float rounding.
    GateError: the tasks file cannot be read."""
    from reefd import __version__

    if tasks_sha256 is None and cfg.tasks:
        path = scenarios_dir / cfg.tasks
        try:
            tasks_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise GateError(f"gate.tasks: {path}: cannot read tasks file: {exc}") from exc
    doc = {"tasks": tasks_sha256, "scorer": cfg.scorer, "scorer_source": _scorer_source(cfg.scorer),
           "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "samples": cfg.samples, "seed": cfg.seed,
           "reefd": __version__, "context": context or {}}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _scorer_source(spec: str) -> str | None:
    """The sha256 of a dotted-path scorer's module file (None for the built-in scorers, or no file)."""
    if spec in SCORERS:
        return None
    try:
        found = importlib.util.find_spec(spec.partition(":")[0])
    except (ImportError, ValueError):
        return None
    origin = found.origin if found is not None else None
    try:
        return hashlib.sha256(Path(origin).read_bytes()).hexdigest() if origin else None
    except OSError:
        return None


