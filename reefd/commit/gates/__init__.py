"""Eval gates: judge a candidate release against the serving one before it may be published.

A gate kind (`gate.kind`: always, holdout, floor, paired, or a `pkg.mod:Class` of your own) is a class with its
own config dataclass, the YAML keys under `gate:` besides `kind`. Knows nothing about engines, models or torch:
answers come from a `Generate` callback that the caller drives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from reefd import plugins, schema
from reefd.commit.gates.tasks import GateError, Task, fingerprint, load_tasks, scorer

__all__ = ["Gate", "GateError", "Generate", "KnownScores", "Sampling", "Task", "Verdict", "build", "fingerprint",
           "json_schema", "load_tasks", "scorer"]


@dataclass(frozen=True)
class Sampling:
    """How a gate's answers are generated: the same for both sides of every task."""

    max_tokens: int
    temperature: float


Generate = Callable[[list[dict[str, Any]], str | None, Sampling, int], Awaitable[str]]
"""(messages, side's adapter name or None for the base model, sampling, seed) -> the answer text.

The caller's engine honours the sampling and the seed, so that both sides sample alike. Its exceptions
propagate out of `evaluate` unchanged.
"""

KnownScores = Callable[[str], Awaitable[list[float] | None]]
"""(gate fingerprint) -> the current side's per-task means under it, measured by an earlier gate, or None."""


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
        return {"fingerprint": self.fingerprint, "current_reused": self.current_reused,
                "verdict": "pass" if self.passed else "fail", "kind": self.kind, "reason": self.reason,
                "tasks": self.tasks, "candidate_mean": self.candidate_mean, "current_mean": self.current_mean,
                "margin": self.margin, "floor": self.floor, "per_task": [dict(p) for p in self.per_task]}


class Gate(Protocol):
    """A gate kind. `Config` is its dataclass; reefd builds a gate as `Kind(config, scenarios_dir)`, where
    `scenarios_dir` is the folder task files are relative to.

    Guarantees a gate gives reefd:
    - `check()` reports at load, as one line naming the key, every problem that would make `evaluate` raise
      GateError (a missing tasks file, a scorer that does not import), so a scenario that loads has a gate that
      runs;
    - `evaluate` generates only through `generate`, with `sampling` and, for a task and sample, the same seed on
      both sides; a candidate that does worse is a failed Verdict, never an exception; `generate`'s own errors
      propagate unchanged;
    - with `known_current`, the current side's scores may come from an earlier gate with the same fingerprint
      (the verdict then says `current_reused`), and only when `reuse_current` is true.
    """

    kind: ClassVar[str]
    Config: ClassVar[type]
    sampling: Sampling | None  # how answers are generated; None: the gate generates nothing
    reuse_current: bool

    def check(self) -> str | None: ...

    async def evaluate(self, generate: Generate, *, current: str | None, candidate: str | None,
                       concurrency: int = 4, context: dict[str, Any] | None = None,
                       known_current: KnownScores | None = None) -> Verdict: ...


def _kind(name: str) -> Any:
    try:
        return plugins.resolve(plugins.GATES, name, "gate kind")
    except plugins.PluginError as exc:
        raise GateError(f"gate.kind: {exc}") from None


def build(raw: dict[str, Any], scenarios_dir: Path) -> Gate:
    """The gate a scenario's `gate:` mapping declares; GateError names `gate.KEY` on a bad key or value."""
    params = dict(raw)
    cls = _kind(str(params.pop("kind", "always")))
    missing = plugins.missing(Gate, cls, instance_attrs=("sampling", "reuse_current"))
    if missing:
        raise GateError(f"gate.kind: {raw.get('kind')!r} is not a Gate (no {', '.join(missing)}); "
                        "see reefd/commit/gates")
    try:
        cfg = schema.parse(cls.Config, params, "gate")
    except schema.SchemaError as exc:
        hint = (f": the {raw.get('kind')} kind has no such key (each kind has its own keys; to change the kind, "
                "choose its group in the defaults list, e.g. `- gate: floor`)") if "Additional properties" in str(exc) \
            else ""
        raise GateError(f"{exc}{hint}") from None
    gate: Gate = cls(cfg, scenarios_dir)
    return gate


def json_schema() -> dict[str, Any]:
    """The `gate:` mapping's JSON Schema for editors: `kind`, then each shipped kind's own keys."""
    branches = []
    for name in plugins.GATES:
        sub = schema.dataclass_schema(_kind(name).Config)
        sub["properties"] = {"kind": {"const": name}, **sub["properties"]}
        branches.append({"if": {"properties": {"kind": {"const": name}}, "required": ["kind"]}, "then": sub})
    kinds = plugins.name_schema(plugins.GATES, "always: pass; holdout: beat the serving release on held-out tasks "
                                "by margin; floor: score at least `floor`; paired: pass iff wins - losses > "
                                "min_win_margin; or pkg.mod:Class, a gate of your own.")
    return {"type": "object", "properties": {"kind": kinds}, "allOf": branches,
            "description": "How a candidate is judged before it may be published."}
