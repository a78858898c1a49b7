"""Judges as Python functions (`recipe.params.judge.model: tests.recipes.judges:NAME`), for tests.

Each answers a JudgeCall with text, which reefd parses exactly as it parses an engine's answer."""

from __future__ import annotations

import asyncio

from reefd.grow.judge import JudgeCall

CORRECTION = "start your answer with"


def scripted(call: JudgeCall) -> str:
    """A user who wants answers to start with "OK:" and says so only as a correction: the correction is a -1
    verdict and a hint; anything else is +1 with no hint."""
    corrected = any(CORRECTION in str(m.get("content", "")).lower() for m in call.next_state)
    if call.kind == "verdict":
        return "The user asks for a change. \\boxed{-1}" if corrected else "The user moves on. \\boxed{1}"
    if corrected:
        return "\\boxed{1} [HINT_START]Start every answer with 'OK:'.[HINT_END]"
    return "\\boxed{-1}"


def garbage(call: JudgeCall) -> str:
    return "\\boxed{7} [HINT_START]x[HINT_END] \\boxed{banana}" if call.vote % 2 else "¯\\_(ツ)_/¯"


def failing(call: JudgeCall) -> str:
    raise RuntimeError("the judge crashed")


async def slow(call: JudgeCall) -> str:
    await asyncio.sleep(3600)
    return "\\boxed{1}"


def split(call: JudgeCall) -> str:
    """Votes 1, -1, 0 in turn: a three-way tie."""
    return f"\\boxed{{{(1, -1, 0)[call.vote % 3]}}}"
