"""A release's lineage (reefd/api/releases.py) from a real chain and a real LMDB store: what the release keeps
of its job (params, trainer figures), a harness release's proposer answer and harness diff from its parent, the
records it learned from at one store read each, and the shape /openapi.json promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

from reefd.api import releases as release_api
from reefd.api.openapi_schemas import SCHEMAS
from reefd.commit.chain import Release, ReleaseChain
from reefd.observe.records import RecordStore
from tests.test_records import record, with_store

RULE = "Answer briefly.\n"
SKILL = "---\nname: git\ndescription: Commit small changes.\n---\n\nUse git add -p.\n"
ANSWER = '{"summary": "commit advice", "decisions": [{"kind": "skill", "name": "commits", "action": "create"}]}'
PARAMS = {"recipe": "skillclaw", "recipe_params": {"batch_size": 2}, "max_tokens": 48, "temperature": 0.0}


class Reads:
    """The real store, counting what lineage asks of it."""

    def __init__(self, store: RecordStore) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.store, name)


def harness(root: Path, skills: dict[str, str]) -> Path:
    (root / "rules").mkdir(parents=True)
    (root / "rules" / "style.md").write_text(RULE)
    for name, text in skills.items():
        (root / "skills" / name).mkdir(parents=True)
        (root / "skills" / name / "SKILL.md").write_text(text)
    return root


def harness_chain(tmp_path: Path, receipts: list[str]) -> tuple[ReleaseChain, Release, Release, Release]:
    """base (a harness) -> an adapter -> a harness release that adds a skill and learned from `receipts`."""
    chain = ReleaseChain(tmp_path / "releases.git")
    base = chain.publish("coder", expected_head=None, kind="base", folder="harness", meta={"source": "base"},
                         artifact_dir=harness(tmp_path / "h0", {"git": SKILL}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}\n')
    tuned = chain.publish("coder", expected_head=base.id, kind="adapter", artifact_dir=adapter,
                          meta={"source": "sao", "job": "j-1", "metrics": {"loss": 0.5, "steps": 3},
                                "params": {"recipe": "sao", "backend": "local", "seed": 7}})
    new_skill = "---\nname: commits\ndescription: Explain why.\n---\n\nStart with a verb.\n"
    mutation = {"op": "create", "kind": "skill", "id": "commits",
                "config": {"description": "Explain why.", "body": "Start with a verb."}}
    grown = chain.publish("coder", expected_head=tuned.id, kind="harness",
                          artifact_dir=harness(tmp_path / "h1", {"git": SKILL, "commits": new_skill}),
                          meta={"source": "skillclaw", "job": "j-2", "summary": "create skill commits",
                                "metrics": {"mutations": 1}, "receipts": receipts, "params": PARAMS,
                                "proposal": ANSWER, "mutations": [mutation], "gate": {"verdict": "pass"}})
    return chain, base, tuned, grown


def test_a_harness_release_explains_its_job_proposal_diff_and_records(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        kept = [record("coder"), record("coder")]
        for r in kept:
            await store.put_record(r)
        await store.put_report("coder", {"references": [kept[0]["id"]], "score": 0.0, "feedback": "say why"})
        receipts = [kept[0]["id"], kept[1]["id"], "01JZZZZZZZZZZZZZZZZZZZZZZZ"]  # the last: deleted by retention
        chain, base, tuned, grown = harness_chain(tmp_path, receipts)
        reads = Reads(store)

        entry = release_api._explained(grown, reads, chain)
        assert reads.calls == ["get_record"] * 3  # one read per record; nothing scanned
        assert (entry["parent"], entry["kind"], entry["recipe"], entry["job"]) == (tuned.id, "harness", "skillclaw",
                                                                                  "j-2")
        assert entry["params"] == PARAMS and entry["proposal"] == ANSWER and entry["gate"] == {"verdict": "pass"}
        assert entry["mutations"][0]["id"] == "commits"
        assert entry["harness_diff"] == (
            "--- /dev/null\n+++ b/harness/skills/commits/SKILL.md\n@@ -0,0 +1,6 @@\n+---\n+name: commits\n"
            "+description: Explain why.\n+---\n+\n+Start with a verb.\n")
        assert [(r["receipt"], r["deleted"], [x["score"] for x in r["reports"]]) for r in entry["learned_from"]] \
            == [(receipts[0], False, [0.0]), (receipts[1], False, []), (receipts[2], True, [])]
        assert entry["learned_from"][0]["reports"][0]["feedback"] == "say why"

        # an adapter release on the same harness: its job's parameters and figures, no harness diff
        before = release_api._explained(tuned, reads, chain)
        assert before["params"] == {"recipe": "sao", "backend": "local", "seed": 7}
        assert before["metrics"] == {"loss": 0.5, "steps": 3} and before["harness_diff"] is None
        assert release_api._explained(base, reads, chain)["harness_diff"] is None  # the base has no parent

        shape = SCHEMAS["Lineage"]["properties"]["releases"]["items"]
        for e in (entry, before):
            jsonschema.validate(e, shape)

    with_store(tmp_path / "db", body)


def test_a_rollback_shows_the_harness_it_brings_back_and_a_long_diff_is_cut(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(store: RecordStore) -> None:
        chain, _, tuned, grown = harness_chain(tmp_path, [])
        back = chain.rollback("coder", expected_head=grown.id)
        entry = release_api._explained(back, store, chain)
        assert entry["kind"] == "rollback" and entry["params"] is None and entry["learned_from"] == []
        assert entry["harness_diff"].startswith("--- a/harness/skills/commits/SKILL.md\n+++ /dev/null\n")
        monkeypatch.setattr(release_api, "MAX_HARNESS_DIFF", 40)
        cut = release_api._explained(grown, store, chain)["harness_diff"]
        assert cut.endswith(f"\n[... cut; reefctl diff {tuned.id} {grown.id} shows all]\n") and len(cut) < 120

    with_store(tmp_path / "db", body)
