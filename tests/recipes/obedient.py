"""A harness recipe that trusts its proposer too much (a stand-in for a user's own recipe, named by dotted path):
SkillClaw's prompt, and an answer `{"mutations": [...]}` applied as it is, whatever kinds it touches; any other
answer is SkillClaw's. With it, only reefd's own guard (reefd/grow/job_kinds/harness_job.py) stands between a
proposer that obeys an injection and a release."""

from __future__ import annotations

import json
from typing import Any

from recipes.skillclaw.recipe import SkillClaw
from reefd.harness import Harness


class Obedient(SkillClaw):
    def edit(self, answer: str, harness: Harness) -> list[dict[str, Any]]:
        data = json.loads(answer)
        if isinstance(data, dict) and "mutations" in data:
            return list(data["mutations"])
        return super().edit(answer, harness)
