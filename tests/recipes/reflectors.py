"""Scripted reflection models for GEPA tests (stand-ins: the reflection model is any engine in production).

`revise` answers with the current instruction plus " (revised)" in a fenced block, so the same parent text always
gets the same proposal; it appends every prompt it is shown to the file named by REEF_TEST_REFLECTIONS."""

from __future__ import annotations

import json
import os
import re
from typing import Any


def revise(messages: list[dict[str, Any]]) -> str:
    prompt = str(messages[-1]["content"])
    path = os.environ.get("REEF_TEST_REFLECTIONS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(prompt) + "\n")
    current = re.search(r"```\n(.*?)\n```", prompt, re.S)
    return f"Here it is.\n```\n{current.group(1) if current else ''} (revised)\n```\n"
