"""A scenario's `practice:` settings: the practice set (a JSONL file of tasks), its verifier and the budget, and
their load-time check (a bad task line is refused naming its file and line). Knows nothing about engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reefd.commit.gates.tasks import GateError, Task, read_tasks
from reefd.grow.practice import code_tasks, sandbox
from reefd.grow.practice.verifiers import Verifier, VerifierConfig, VerifierError


@dataclass
class PracticeConfig:
    """Proactive experience: reefd answers the practice set's tasks with the serving release, in the background,
    has the verifier check each answer, and keeps both as practice records and `source: verifier` reports, which
    recipes train on as on any scored records (SAO with samples: 1, GRPO with a group of k)."""

    tasks: str | None = field(default=None, metadata={
        "description": "JSONL practice set, relative to the scenarios folder: one object per line with `prompt` "
                       "(a string or OpenAI messages) and whatever the verifier reads (task.json holds the line; "
                       "for `verifier.code`, `entry` and `tests`, and the file must lie in the scenarios folder, "
                       "which that verifier's sandbox hides). null: no practice."})
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    tasks_per_round: int = field(default=8, metadata={"minimum": 1, "maximum": 100_000,
                                                      "description": "Tasks answered per round, in turn through "
                                                                     "the set (shuffled once by `seed`)."})
    samples: int = field(default=1, metadata={"minimum": 1, "maximum": 64,
                                              "description": "Answers per task and round: 1 for SAO, k (a group "
                                                             "of the same prompt) for GRPO."})
    rounds_per_hour: float = field(default=3600.0, metadata={
        "exclusiveMinimum": 0, "maximum": 3600,
        "description": "How often a round starts at most (one at a time: a round that runs long delays the next). "
                       "3600, the default: each round as soon as the last one ended (with `max_waiting`, as soon "
                       "as the trainer took its batch); lower it to ration practice."})
    concurrency: int = field(default=1, metadata={"minimum": 1, "maximum": 64,
                                                  "description": "Practice answers generating at once; they take "
                                                                 "only idle engine turns."})
    max_waiting: int | None = field(default=None, metadata={
        "minimum": 1, "description": "A round waits while this many of the scenario's scored records (practice or "
                                     "not) wait for a Grow job, and while the scenario's job runs: practice then "
                                     "answers with the release that job makes, not ahead of the trainer, and "
                                     "leaves the CPU to it meanwhile. null: no bound."})
    preempt: bool = field(default=True, metadata={
        "description": "true: practice generates only while the engine serves no request, and a request that "
                       "comes stops the practice answers generating (each is asked again once the engine is idle); "
                       "false: it takes up to half the engine's turns beside requests, while none waits."})
    max_tokens: int = field(default=64, metadata={"minimum": 1, "maximum": 32_768,
                                                  "description": "Answer length."})
    temperature: float = field(default=1.0, metadata={"minimum": 0, "maximum": 2,
                                                      "description": "Sampling temperature of practice answers."})
    seed: int = field(default=0, metadata={"minimum": 0, "maximum": 2**63 - 1,
                                           "description": "The order the set is gone through in."})


def load(cfg: PracticeConfig, scenarios_dir: Path) -> list[Task]:
    """The practice set's tasks; GateError (naming the file and line) for a set that cannot be used. A code
    verifier's set must lie in the scenarios folder (its sandbox hides that folder, so the candidate never reads
    the set's expected values), and each line must be a code task."""
    assert cfg.tasks is not None
    path, code = scenarios_dir / cfg.tasks, cfg.verifier.code is not None
    if code and not path.resolve().is_relative_to(scenarios_dir.resolve()):
        raise GateError(f"{path}: a code practice set must lie in the scenarios folder, which the code sandbox hides")
    tasks, _ = read_tasks(path, required=("prompt", "entry", "tests") if code else ("prompt",))
    if not tasks:
        raise GateError(f"{path}: no tasks")
    for task in tasks if code else ():
        if (problem := code_tasks.task_problem(task.raw)) is not None:
            raise GateError(f"{task.where}: {problem}")
    return tasks


def problem(cfg: PracticeConfig, scenarios_dir: Path) -> str | None:
    """Why the practice settings cannot work (one line), or None: the set, the verifier and the sandbox."""
    if cfg.tasks is None:
        return None
    try:
        load(cfg, scenarios_dir)
        Verifier(cfg.verifier, scenarios_dir, ())
        sandbox.check()
    except (GateError, VerifierError, sandbox.SandboxUnavailable) as exc:
        return f"practice: {exc}" if not str(exc).startswith("practice") else str(exc)
    return None
