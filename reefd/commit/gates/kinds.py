"""The shipped gate kinds and their configs: always, holdout, floor and paired.

Each kind owns its config dataclass (its YAML keys) and its pass rule; the ones that answer held-out tasks share
one evaluation: tasks and scorer, both sides' answers with shared seeds, per-task means, then the kind's rule.
Knows nothing about engines: answers come from the caller's `generate`.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from reefd.commit.gates import Generate, KnownScores, Sampling, Verdict
from reefd.commit.gates.tasks import GateError, Scorer, Task, TaskConfig, fingerprint, read_tasks, scorer

EPS = 1e-9  # means are float sums: 0.7 - 0.6 must clear a 0.1 margin


@dataclass
class AlwaysConfig:
    """always: every candidate passes; nothing is generated (for experiments; production scenarios gate)."""


class Always:
    kind: ClassVar[str] = "always"
    Config: ClassVar[type] = AlwaysConfig

    def __init__(self, cfg: AlwaysConfig, scenarios_dir: Path) -> None:
        self.cfg = cfg
        self.sampling: Sampling | None = None
        self.reuse_current = False

    def check(self) -> str | None:
        return None

    async def evaluate(self, generate: Generate, *, current: str | None, candidate: str | None, concurrency: int = 4,
                       context: dict[str, Any] | None = None, known_current: KnownScores | None = None) -> Verdict:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        return Verdict(True, "always", None, None, 0, 0.0, None, "gate kind is always", [])


class TaskGate:
    """A gate that answers held-out tasks. A task's score is the mean of its `samples` answers; a mean is over
    tasks. Requests go out in the order task, sample, side (the sides alternate, so both meet the same engine
    load) with seed `seed + task index * samples + sample` on both sides. Fewer than `min_tasks` tasks is a
    failed verdict. Subclasses say which sides answer and decide on the per-task means."""

    kind: ClassVar[str]
    Config: ClassVar[type]
    asks_current: ClassVar[bool] = True

    def __init__(self, cfg: TaskConfig, scenarios_dir: Path, *, floor: float | None = None, margin: float = 0.0,
                 reuse_current: bool = False) -> None:
        self.cfg = cfg
        self.scenarios_dir = scenarios_dir
        self.sampling: Sampling | None = Sampling(cfg.max_tokens, cfg.temperature)
        self.floor = None if floor is None else float(floor)
        self.margin = float(margin)
        self.reuse_current = reuse_current

    def _prepare(self) -> tuple[list[Task], Scorer, str]:
        """The tasks, the scorer and the tasks file's sha256; GateError names the key at fault."""
        cfg = self.cfg
        if not cfg.tasks:
            raise GateError(f"gate.tasks: a {self.kind} gate needs a tasks file")
        floor = self.floor
        if floor is not None and not 0.0 <= floor <= 1.0:
            raise GateError(f"gate.floor: {floor} is outside [0, 1], where scores lie")
        try:
            score = scorer(cfg.scorer)
        except GateError as exc:
            raise GateError(f"gate.scorer: {exc}") from None
        try:
            tasks, digest = read_tasks(self.scenarios_dir / cfg.tasks)
        except GateError as exc:
            raise GateError(f"gate.tasks: {exc}") from None
        return tasks, score, digest

    def check(self) -> str | None:
        """Loads the tasks file and imports the scorer; a file with fewer than min_tasks tasks is reported too,
        since such a gate can never pass."""
        try:
            tasks, _, _ = self._prepare()
        except GateError as exc:
            return str(exc)
        if len(tasks) < self.cfg.min_tasks:
            return (f"gate.tasks: {self.cfg.tasks} holds {len(tasks)} tasks, fewer than min_tasks "
                    f"{self.cfg.min_tasks}: the gate would always fail")
        return None

    async def evaluate(self, generate: Generate, *, current: str | None, candidate: str | None, concurrency: int = 4,
                       context: dict[str, Any] | None = None, known_current: KnownScores | None = None) -> Verdict:
        """Judge `candidate` (an adapter name, None for the base model) against `current`. `context` goes into
        the fingerprint; `known_current(fingerprint)` may give the current side's per-task means, which then
        stand in for generating them (only for a kind that asks the current side)."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        tasks, score, tasks_sha256 = await asyncio.to_thread(self._prepare)  # file reads, imports: off the loop
        n = len(tasks)
        digest = await asyncio.to_thread(fingerprint, self.cfg, self.scenarios_dir, context, tasks_sha256=tasks_sha256)
        known = await known_current(digest) if known_current is not None and self.asks_current else None
        reuse = known is not None and len(known) == n

        def verdict(passed: bool, reason: str, cand: float | None = None, cur: float | None = None,
                    per_task: list[dict[str, float | None]] | None = None) -> Verdict:
            return Verdict(passed, self.kind, cand, cur, n, self.margin, self.floor, reason, per_task or [], digest,
                           reuse and cur is not None)

        if n < max(self.cfg.min_tasks, 1):  # a mean of no tasks means nothing
            return verdict(False, f"{n} tasks, fewer than min_tasks {max(self.cfg.min_tasks, 1)}")
        sides = {"candidate": candidate} if reuse or not self.asks_current else \
            {"candidate": candidate, "current": current}
        means = await self._answer_all(tasks, sides, score, generate, concurrency)
        cand_scores = means["candidate"]
        cur_scores = [float(x) for x in known] if reuse and known is not None else means.get("current")
        per_task: list[dict[str, float | None]] = [
            {"candidate": c, "current": cur_scores[i] if cur_scores else None} for i, c in enumerate(cand_scores)]
        cand = _mean(cand_scores)
        floor_ok = self.floor is None or cand >= self.floor - EPS
        floor_note = "" if self.floor is None else f", floor {self.floor:g} {'met' if floor_ok else 'missed'}"
        reused = " (current's scores from its own gate)" if reuse else ""
        passed, reason = self.decide(cand_scores, cur_scores, reused)
        return verdict(passed and floor_ok, reason + floor_note, cand,
                       _mean(cur_scores) if cur_scores else None, per_task)

    def decide(self, cand: list[float], cur: list[float] | None, reused: str) -> tuple[bool, str]:
        """(the kind's own rule passed, the reason) on the per-task means; the floor is checked after."""
        raise NotImplementedError

    async def _answer_all(self, tasks: list[Task], sides: dict[str, str | None], score: Scorer,
                          generate: Generate, concurrency: int) -> dict[str, list[float]]:
        """Each side's mean score per task, generating with at most `concurrency` requests in flight."""
        cfg, sampling = self.cfg, self.sampling
        assert sampling is not None
        samples: dict[str, list[list[float]]] = {side: [[] for _ in tasks] for side in sides}
        jobs = iter([(i, cfg.seed + i * cfg.samples + s, side)
                     for i in range(len(tasks)) for s in range(cfg.samples) for side in sides])

        async def worker() -> None:
            for i, seed, side in jobs:  # the workers share one iterator: each request is made once
                task = tasks[i]
                text = await generate(copy.deepcopy(task.messages), sides[side], sampling, seed)
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


@dataclass
class HoldoutConfig(TaskConfig):
    """holdout: the candidate must beat the serving release's mean on the tasks by `margin`."""

    margin: float = field(default=0.0, metadata={
        "description": "Required mean improvement; 0 asks for a strict one (a tie fails), a negative margin "
                       "tolerates that much regression."})
    floor: float | None = field(default=None, metadata={"description": "Also required: a candidate mean."})
    reuse_current: bool = field(
        default=True,
        metadata={"description": "Weight candidates: take the serving release's per-task scores from the gate "
                                 "that admitted it, when that gate had the same fingerprint (tasks file bytes, "
                                 "scorer and its module's source, sampling, seeds, model settings, reefd "
                                 "version), instead of generating them again (half the gate's work). Only at "
                                 "temperature 0 or on the worker engine, whose seeded sampling is reproducible. "
                                 "false: both sides are generated at every gate."})


class Holdout(TaskGate):
    kind = "holdout"
    Config = HoldoutConfig

    def __init__(self, cfg: HoldoutConfig, scenarios_dir: Path) -> None:
        super().__init__(cfg, scenarios_dir, floor=cfg.floor, margin=cfg.margin, reuse_current=cfg.reuse_current)

    def decide(self, cand: list[float], cur: list[float] | None, reused: str) -> tuple[bool, str]:
        assert cur is not None
        margin = self.margin
        a, b = _mean(cand), _mean(cur)
        diff = a - b
        beat = diff > EPS if margin == 0 else diff >= margin - EPS
        need = "> 0" if margin == 0 else f">= {margin:+g}"
        return beat, f"candidate {a:.3f} vs current {b:.3f}{reused} on {len(cand)} tasks: {diff:+.3f} (needs {need})"


@dataclass
class FloorConfig(TaskConfig):
    """floor: the candidate alone answers; it passes when its mean is at least `floor`."""

    floor: float | None = field(default=None, metadata={"description": "The minimum candidate mean (required)."})


class Floor(TaskGate):
    kind = "floor"
    Config = FloorConfig
    asks_current = False

    def __init__(self, cfg: FloorConfig, scenarios_dir: Path) -> None:
        super().__init__(cfg, scenarios_dir, floor=cfg.floor)

    def _prepare(self) -> tuple[list[Task], Scorer, str]:
        if self.cfg.tasks and self.floor is None:
            raise GateError("gate.floor: a floor gate needs a floor")
        return super()._prepare()

    def decide(self, cand: list[float], cur: list[float] | None, reused: str) -> tuple[bool, str]:
        return True, f"candidate {_mean(cand):.3f} on {len(cand)} tasks"


@dataclass
class PairedConfig(TaskConfig):
    """paired: each task once with the candidate and once with the current release; the candidate passes iff
    wins - losses > min_win_margin."""

    min_win_margin: int = field(default=0, metadata={"description": "wins - losses must exceed this."})
    floor: float | None = field(default=None, metadata={"description": "Also required: a candidate mean."})
    reuse_current: bool = field(default=True, metadata={"description": "As for holdout."})


class Paired(TaskGate):
    kind = "paired"
    Config = PairedConfig

    def __init__(self, cfg: PairedConfig, scenarios_dir: Path) -> None:
        super().__init__(cfg, scenarios_dir, floor=cfg.floor, reuse_current=cfg.reuse_current)
        self.min_win_margin = cfg.min_win_margin

    def decide(self, cand: list[float], cur: list[float] | None, reused: str) -> tuple[bool, str]:
        assert cur is not None
        need = self.min_win_margin
        wins = sum(c > k + EPS for c, k in zip(cand, cur, strict=True))
        losses = sum(k > c + EPS for c, k in zip(cand, cur, strict=True))
        n = len(cand)
        return wins - losses > need, (f"paired on {n} tasks{reused}: {wins} wins, {losses} losses, "
                                      f"{n - wins - losses} ties; wins - losses {wins - losses:+d} "
                                      f"(needs > {need:+d})")
