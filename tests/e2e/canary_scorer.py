"""A shadow scorer for tests/e2e/test_canary.py: 1 when a record's answer is the reference answer to its prompt.

The references sit in the scenario folder as references.json (prompt -> answer), written by the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def score(record: dict[str, Any]) -> float:
    folder = Path(os.environ.get("REEF_TEST_SCENARIOS", "."))
    references = json.loads((folder / "references.json").read_text())
    messages = record["messages"]
    prompt = next(m["content"] for m in messages if m["role"] == "user")
    return 1.0 if messages[-1]["content"] == references.get(prompt) else 0.0
