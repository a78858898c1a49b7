"""Shipped verifier functions, for `practice.verifier.function`: each takes (answer, task) and compares the answer
with the task's `answer`. Run in the sandbox like any function verifier (reefd/grow/practice/call.py)."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(answer: str, task: dict[str, Any]) -> bool:
    """Right when the answer's first number equals the task's `answer` as numbers ("7", "7.0" and 7 alike)."""
    found = _NUMBER.search(answer)
    return found is not None and float(found.group()) == float(task["answer"])


def last_number(answer: str, task: dict[str, Any]) -> bool:
    """Right when the answer's last number equals the task's `answer` ("3 + 4 = 7" is right for 7)."""
    found = _NUMBER.findall(answer)
    return bool(found) and float(found[-1]) == float(task["answer"])


def exact(answer: str, task: dict[str, Any]) -> bool:
    """Right when the answer, stripped, is the task's `answer`."""
    return answer.strip() == str(task["answer"]).strip()
