"""Eval gates: judge a candidate release on held-out tasks before it may be published.

Owns the task file format, the scorers and the pass rules. Knows nothing about engines,
models or torch: answers come from a `Generate` callback that the caller drives.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reefd.config import GateConfig

EPS = 1e-9  # means are float sums: 0.7 - 0.6 must clear a 0.1 margin


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

KnownScores = Callable[[str], Awaitable[list[float] | None]]
"""(gate fingerprint) -> the current side's per-task means under it, measured by an earlier gate, or None."""

Generate = Callable[[list[dict[str, Any]], str | None, GateConfig, int], Awaitable[str]]
"""(messages, adapter name or None for the base model, gate config, seed) -> the answer text.

The caller's engine honours cfg.max_tokens and cfg.temperature, and the seed, so that both sides
of a holdout gate sample alike. Its exceptions propagate out of `evaluate` unchanged.
"""


# ---------------------------------------------------------------- tasks


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
    return _read_tasks(path)[0]


def _read_tasks(path: Path) -> tuple[list[Task], str]:
    """The tasks, and the sha256 of the very bytes they were parsed from."""
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
        for key in ("prompt", "answer"):
            if key not in obj:
                raise GateError(f"{where}: missing {key!r}")
        tasks.append(Task(messages=_messages(obj["prompt"], where), answer=obj["answer"], raw=obj, where=where))
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


# ---------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    """What a gate decided, and the numbers it decided on."""

    passed: bool
    kind: str
    candidate_mean: float | None  # None: nothing was generated
    current_mean: float | None  # None: the current release was not asked (always, floor)
    tasks: int
    margin: float
    floor: float | None
    reason: str  # one line, for logs and `reefctl releases`
    per_task: list[dict[str, float | None]]  # [{"candidate": mean, "current": mean or None}] in file order
    fingerprint: str | None = None  # what the per-task scores depend on besides the weights (see fingerprint())
    current_reused: bool = False  # the current side's scores came from an earlier gate, not from generation

    def as_meta(self) -> dict[str, Any]:
        """The JSON-able record kept in release.json meta["gate"]."""
        return {
            "fingerprint": self.fingerprint,
            "current_reused": self.current_reused,
            "verdict": "pass" if self.passed else "fail",
            "kind": self.kind,
            "reason": self.reason,
            "tasks": self.tasks,
            "candidate_mean": self.candidate_mean,
            "current_mean": self.current_mean,
            "margin": self.margin,
            "floor": self.floor,
            "per_task": [dict(p) for p in self.per_task],
        }


def fingerprint(cfg: GateConfig, scenarios_dir: Path, context: dict[str, Any] | None = None, *,
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


def _prepare(cfg: GateConfig, scenarios_dir: Path) -> tuple[list[Task], Scorer, str]:
    """The tasks, scorer and tasks file sha256 of a holdout, floor or paired gate; GateError names the key at
    fault."""
    if cfg.kind not in ("holdout", "floor", "paired"):
        raise GateError(f"gate.kind: unknown gate kind {cfg.kind!r}")
    if not cfg.tasks:
        raise GateError(f"gate.tasks: a {cfg.kind} gate needs a tasks file")
    if cfg.kind == "floor" and cfg.floor is None:
        raise GateError("gate.floor: a floor gate needs a floor")
    if cfg.floor is not None and not 0.0 <= cfg.floor <= 1.0:
        raise GateError(f"gate.floor: {cfg.floor} is outside [0, 1], where scores lie")
    try:
        score = scorer(cfg.scorer)
    except GateError as exc:
        raise GateError(f"gate.scorer: {exc}") from None
    try:
        tasks, digest = _read_tasks(scenarios_dir / cfg.tasks)
    except GateError as exc:
        raise GateError(f"gate.tasks: {exc}") from None
    return tasks, score, digest


def check_config(cfg: GateConfig, scenarios_dir: Path) -> str | None:
    """The problem with a gate config, as one line for `reefd --check`, or None when it can run.

    Loads the tasks file and imports the scorer, so a gate that --check accepts does not fail
    on its configuration later; a tasks file with fewer than min_tasks tasks is reported too,
    since such a gate can never pass.
    """
    if cfg.kind == "always":
        return None
    try:
        tasks, _, _ = _prepare(cfg, scenarios_dir)
    except GateError as exc:
        return str(exc)
    if len(tasks) < cfg.min_tasks:
        return (f"gate.tasks: {cfg.tasks} holds {len(tasks)} tasks, fewer than min_tasks {cfg.min_tasks}: "
                "the gate would always fail")
    return None


# ---------------------------------------------------------------- evaluation


async def _answer_all(tasks: list[Task], sides: dict[str, str | None], cfg: GateConfig, score: Scorer,
                      generate: Generate, concurrency: int) -> dict[str, list[float]]:
    """Each side's mean score per task, generating with at most `concurrency` requests in flight.

    Requests go out in the order task, sample, side: the sides alternate, so both meet the same
    engine load, and both get the same seed for the same task and sample.
    """
    samples: dict[str, list[list[float]]] = {side: [[] for _ in tasks] for side in sides}
    jobs = iter([(i, cfg.seed + i * cfg.samples + s, side)
                 for i in range(len(tasks)) for s in range(cfg.samples) for side in sides])

    async def worker() -> None:
        for i, seed, side in jobs:  # the workers share one iterator: each job is taken once
            task = tasks[i]
            text = await generate(copy.deepcopy(task.messages), sides[side], cfg, seed)
            samples[side][i].append(score(text, task))

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return {side: [_mean(xs) for xs in per] for side, per in samples.items()}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


async def evaluate(cfg: GateConfig, scenarios_dir: Path, generate: Generate, *, current: str | None,
                   candidate: str | None, concurrency: int = 4, context: dict[str, Any] | None = None,
                   known_current: KnownScores | None = None) -> Verdict:
    """Judge `candidate` (an adapter name, None for the base model) by the gate `cfg`.

    always: passes without generating. floor: passes iff the candidate's mean is at least
    cfg.floor. holdout: the candidate and `current` answer the same tasks with the same seeds
    (cfg.seed + task index * cfg.samples + sample); it passes iff the candidate's mean exceeds
    the current one by at least cfg.margin, where a margin of 0 asks for a strict improvement
    (a tie is no reason to publish) and a negative margin tolerates that much regression;
    cfg.floor, when set, must be met as well. Comparisons allow 1e-9 of float rounding.

    A task's score is the mean of its cfg.samples answers; a mean is over tasks. Fewer than
    cfg.min_tasks tasks is a failed verdict; configuration problems raise GateError.

    `context` goes into the verdict's fingerprint (see fingerprint()). `known_current(fingerprint)` gives the
    current side's per-task means measured by an earlier gate with this fingerprint, or None: when there is a
    mean for every task, the current side is not generated again and the verdict says so.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    if cfg.kind == "always":
        return Verdict(True, "always", None, None, 0, cfg.margin, cfg.floor, "gate kind is always", [])
    tasks, score, tasks_sha256 = _prepare(cfg, scenarios_dir)
    n = len(tasks)
    digest = fingerprint(cfg, scenarios_dir, context, tasks_sha256=tasks_sha256)
    known = await known_current(digest) if known_current is not None and cfg.kind != "floor" else None
    reuse = known is not None and len(known) == n

    def verdict(passed: bool, reason: str, cand: float | None = None, cur: float | None = None,
                per_task: list[dict[str, float | None]] | None = None) -> Verdict:
        return Verdict(passed, cfg.kind, cand, cur, n, cfg.margin, cfg.floor, reason, per_task or [], digest,
                       reuse and cur is not None)

    if n < max(cfg.min_tasks, 1):  # the schema says min_tasks >= 1; a mean of no tasks means nothing
        return verdict(False, f"{n} tasks, fewer than min_tasks {max(cfg.min_tasks, 1)}")
    sides = {"candidate": candidate} if cfg.kind == "floor" or reuse else {"candidate": candidate, "current": current}
    means = await _answer_all(tasks, sides, cfg, score, generate, concurrency)
    cand_scores, cur_scores = means["candidate"], means.get("current")
    if reuse:
        assert known is not None
        cur_scores = [float(x) for x in known]
    per_task: list[dict[str, float | None]] = [
        {"candidate": c, "current": cur_scores[i] if cur_scores else None} for i, c in enumerate(cand_scores)]
    cand = _mean(cand_scores)
    floor_ok = cfg.floor is None or cand >= cfg.floor - EPS
    floor_note = "" if cfg.floor is None else f", floor {cfg.floor:g} {'met' if floor_ok else 'missed'}"
    if cur_scores is None:  # a floor gate (which _prepare made sure has a floor)
        return verdict(floor_ok, f"candidate {cand:.3f} on {n} tasks{floor_note}", cand, None, per_task)
    cur = _mean(cur_scores)
    reused = " (current's scores from its own gate)" if reuse else ""
    if cfg.kind == "paired":
        wins = sum(c > k + EPS for c, k in zip(cand_scores, cur_scores, strict=True))
        losses = sum(k > c + EPS for c, k in zip(cand_scores, cur_scores, strict=True))
        reason = (f"paired on {n} tasks{reused}: {wins} wins, {losses} losses, {n - wins - losses} ties; "
                  f"wins - losses {wins - losses:+d} (needs > {cfg.min_win_margin:+d}){floor_note}")
        return verdict(wins - losses > cfg.min_win_margin and floor_ok, reason, cand, cur, per_task)
    diff = cand - cur
    beat = diff > EPS if cfg.margin == 0 else diff >= cfg.margin - EPS
    need = "> 0" if cfg.margin == 0 else f">= {cfg.margin:+g}"
    reason = (f"candidate {cand:.3f} vs current {cur:.3f}{reused} on {n} tasks: {diff:+.3f} (needs {need})"
              f"{floor_note}")
    return verdict(beat and floor_ok, reason, cand, cur, per_task)
