"""Scorers for the SkillClaw demo's task set (imported by reefd as bench.skillclaw_tasks:NAME)."""

from __future__ import annotations

from typing import Any


def mentions_commit(text: str, task: Any) -> float:
    """1 when the answer talks about writing a commit message (a summary line and why), else 0."""
    lowered = text.lower()
    return float("commit" in lowered and ("message" in lowered or "summary" in lowered))
