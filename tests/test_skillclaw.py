"""The SkillClaw recipe: which turns are eligible, the proposer prompt, and the answer -> exact skill mutations,
with every malformed or unsafe answer refused by one clear RecipeError. Real harnesses, no daemon, no model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from recipes.skillclaw.recipe import SkillClaw, SkillClawConfig
from reefd import config
from reefd.grow.recipes import HarnessJob, RecipeError, build
from reefd.harness import Entry, Harness
from tests.conftest import ROOT, make_scenarios

PATH = "recipes.skillclaw.recipe:SkillClaw"
TESTS_BODY = "# Run tests\n\nRun `pytest -q`."


def pool() -> Harness:
    return Harness([
        Entry("run-tests", "skill", {"description": "Run the test suite.", "body": TESTS_BODY}),
        Entry("style", "skill", {"description": "House style for Python.", "body": "Use ruff."}),
        Entry("be-brief", "rules", {"body": "Answer briefly."}),
    ])


def recipe(**params: Any) -> SkillClaw:
    r = build(PATH, params)
    assert isinstance(r, SkillClaw)
    return r


def record(answer: str = "Done: I ran pytest as the run-tests skill says.", rid: str = "rcpt_1") -> dict[str, Any]:
    return {"id": rid, "messages": [
        {"role": "system", "content": "# Harness\n\n## Skills\n\n- run-tests: ...\n- style: ..."},
        {"role": "user", "content": "Fix the failing test in parser.py"},
        {"role": "assistant", "content": answer}]}


def answer(*decisions: dict[str, Any], summary: str = "what the batch shows") -> str:
    return json.dumps({"summary": summary, "decisions": list(decisions)})


def decision(skill: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"skill": skill, "action": action, "reason": "the sessions show it", **fields}


# ---------------------------------------------------------------- eligibility


def test_low_score_is_eligible_without_token_ids() -> None:
    s = recipe().sample(record(), [{"report_id": "rpt_1", "score": 0.9}, {"report_id": "rpt_2", "score": 0.5}])
    assert s is not None  # the latest score (0.5) is at or below low_score; the record has no token ids at all
    assert (s.receipt, s.reward, s.reports) == ("rcpt_1", 0.5, ["rpt_1", "rpt_2"])
    assert (s.prompt_ids, s.completion_ids, s.logprobs) == ([], [], [])
    assert s.context == {"messages": record()["messages"], "feedback": [], "score": 0.5}


def test_feedback_makes_a_turn_eligible_whatever_its_score() -> None:
    r = recipe()
    text = r.sample(record(), [{"report_id": "rpt_1", "score": 1.0, "feedback": "  ran the whole suite twice  "}])
    assert text is not None and text.context["feedback"] == ["ran the whole suite twice"] and text.reward == 1.0
    structured = r.sample(record(), [{"report_id": "rpt_1", "feedback": {"tests": "failed", "file": "parser.py"}}])
    assert structured is not None and structured.reward == 0.0 and structured.context["score"] is None
    assert structured.context["feedback"] == [{"tests": "failed", "file": "parser.py"}]


@pytest.mark.parametrize("reports", [
    [{"report_id": "rpt_1", "score": 0.9}],  # a good score and nothing said
    [{"report_id": "rpt_1", "score": 0.1}, {"report_id": "rpt_2", "score": 0.8}],  # the latest score counts
    [{"report_id": "rpt_1", "score": 0.9, "feedback": "   "}, {"report_id": "rpt_2", "feedback": {}}],  # empty
    [{"report_id": "rpt_1", "score": True}],  # a boolean is not a score
    [],
])
def test_good_or_silent_turns_are_not_eligible(reports: list[dict[str, Any]]) -> None:
    assert recipe().sample(record(), reports) is None


def test_unfinished_turns_are_not_eligible() -> None:
    unfinished = {"id": "rcpt_1", "messages": [{"role": "user", "content": "hi"}]}
    assert recipe().sample(unfinished, [{"report_id": "rpt_1", "score": 0.0}]) is None
    assert recipe().sample({"id": "rcpt_2"}, [{"report_id": "rpt_1", "score": 0.0}]) is None


def test_ready_counts_the_batch() -> None:
    r = recipe(batch_size=2)
    s = r.sample(record(), [{"report_id": "rpt_1", "score": 0.0}])
    assert s is not None and not r.ready([s]) and r.ready([s, s])


# ---------------------------------------------------------------- proposer prompt


def test_prompt_shows_the_feedback_the_scores_and_the_pool_by_skill() -> None:
    r = recipe(batch_size=2, max_edits=3, proposer={"engine": "upstream", "url": "http://x/v1"}, max_tokens=900,
               temperature=0.3)
    bad = r.sample(record(), [{"report_id": "rpt_1", "score": 0.0, "feedback": "it ran every test after each edit"}])
    fb = r.sample(record("Fixed.", "rcpt_2"), [{"report_id": "rpt_2", "feedback": {"missing": "changelog entry"}}])
    extra = r.sample(record(rid="rcpt_3"), [{"report_id": "rpt_3", "score": 0.1}])
    assert bad and fb and extra
    job = r.candidate([bad, fb, extra], pool())
    assert isinstance(job, HarnessJob) and [s.receipt for s in job.samples] == ["rcpt_1", "rcpt_2"]
    assert (job.max_tokens, job.temperature, job.proposer) == (900, 0.3, {"engine": "upstream", "url": "http://x/v1"})
    system, user = (m["content"] for m in job.messages)
    assert [m["role"] for m in job.messages] == ["system", "user"]
    for action in ("improve_skill", "optimize_description", "create_skill", "skip"):
        assert action in system
    assert "At most 3 decisions" in system and '"decisions"' in system and "An example answer" in system
    assert "it ran every test after each edit" in user and '{"missing": "changelog entry"}' in user
    assert "score: 0 (negative)" in user and "score: unscored" in user
    assert "Fix the failing test in parser.py" in user and "# Harness" not in user  # system prompts left out
    assert "## run-tests\ndescription: Run the test suite.\nsessions referring to it: 1" in user
    assert TESTS_BODY in user
    assert "## style\ndescription: House style for Python.\nsessions referring to it: none" in user
    assert "be-brief" not in user  # rules are not skills


def test_prompt_truncates_long_conversations_and_bodies() -> None:
    r = recipe(batch_size=1)
    long = "x" * 5000
    s = r.sample(record(long), [{"report_id": "rpt_1", "score": 0.0}])
    assert s is not None
    big = Harness([Entry("huge", "skill", {"description": "A big skill.", "body": "y" * 20000})])
    user = r.candidate([s], big).messages[1]["content"]
    assert "characters not shown" in user and long not in user and "y" * 20000 not in user
    assert len(user) < 4000


def test_a_recipe_without_a_harness_is_refused() -> None:
    s = recipe().sample(record(), [{"report_id": "rpt_1", "score": 0.0}])
    assert s is not None
    with pytest.raises(RecipeError, match=r"set harness\.dir"):
        recipe().candidate([s], None)


def test_config_validates_the_proposer_model() -> None:
    with pytest.raises(RecipeError, match=r"recipe.params.proposer.engine: 'gpt' is not one of"):
        build(PATH, {"proposer": {"engine": "gpt"}})
    with pytest.raises(RecipeError, match=r"recipe.params.max_edits: 0 is less than the minimum of 1"):
        build(PATH, {"max_edits": 0})
    assert SkillClaw.produces == "harness" and SkillClaw.Config is SkillClawConfig


# ---------------------------------------------------------------- answers -> mutations


def test_improve_skill_updates_the_body_and_keeps_the_description() -> None:
    out = recipe().edit(answer(decision("run-tests", "improve_skill", body="\n# Run tests\n\nRun `pytest -x`.\n")),
                        pool())
    assert out == [{"op": "update", "id": "run-tests", "kind": "skill",
                    "config": {"description": "Run the test suite.", "body": "# Run tests\n\nRun `pytest -x`."}}]


def test_improve_skill_may_set_the_description_too() -> None:
    out = recipe().edit(answer(decision("style", "improve_skill", description="Python style: ruff, types.",
                                        body="Use ruff and mypy.")), pool())
    assert out == [{"op": "update", "id": "style", "kind": "skill",
                    "config": {"description": "Python style: ruff, types.", "body": "Use ruff and mypy."}}]


def test_optimize_description_changes_only_the_description() -> None:
    out = recipe().edit(answer(decision("run-tests", "optimize_description",
                                        description="  Run tests. Use after every code change.  ")), pool())
    assert out == [{"op": "update", "id": "run-tests", "kind": "skill",
                    "config": {"description": "Run tests. Use after every code change.", "body": TESTS_BODY}}]


def test_create_skill_creates_and_the_result_applies() -> None:
    h = pool()
    out = recipe().edit(answer(decision("release", "create_skill", description="Cut a release.",
                                        body="1. Bump the version.\n2. Tag."),
                               decision("style", "skip")), h)
    assert out == [{"op": "create", "id": "release", "kind": "skill",
                    "config": {"description": "Cut a release.", "body": "1. Bump the version.\n2. Tag."}}]
    assert h.apply(out).files()["skills/release/SKILL.md"] == (
        b"---\nname: release\ndescription: Cut a release.\n---\n\n1. Bump the version.\n2. Tag.\n")


def test_several_decisions_keep_their_order() -> None:
    out = recipe().edit(answer(decision("style", "optimize_description", description="Style."),
                               decision("new-one", "create_skill", description="New.", body="Body."),
                               decision("run-tests", "improve_skill", body="Run `pytest -q` once.")), pool())
    assert [(m["op"], m["id"]) for m in out] == [("update", "style"), ("create", "new-one"), ("update", "run-tests")]


def test_skips_and_unchanged_skills_propose_nothing() -> None:
    r = recipe()
    assert r.edit(answer(decision("run-tests", "skip"), decision("anything at all", "skip")), pool()) == []
    assert r.edit(answer(), pool()) == []
    same = decision("run-tests", "improve_skill", body=TESTS_BODY + "\n\n", description="Run the test suite.")
    assert r.edit(answer(same), pool()) == []


@pytest.mark.parametrize("text", [
    "```json\n{answer}\n```",
    "Here is my decision.\n\n```json\n{answer}\n```\nThat is all.",
    "I looked at the sessions; the answer:\n{answer}\nDone.",
    "<think>maybe {{\"summary\": 1}}</think>\n{answer}",
])
def test_fenced_or_wrapped_json_is_accepted(text: str) -> None:
    body = "Run:\n```bash\npytest -x\n```"  # a fence inside the body does not end the answer's fence
    inner = answer(decision("run-tests", "improve_skill", body=body))
    out = recipe().edit(text.format(answer=inner), pool())
    assert out[0]["config"]["body"] == body


def test_a_harness_from_a_folder_works_the_same(tmp_path: Path) -> None:
    pool().render(tmp_path / "h")
    h = Harness.from_dir(tmp_path / "h")
    out = recipe().edit(answer(decision("style", "optimize_description", description="Style rules.")), h)
    assert out == [{"op": "update", "id": "style", "kind": "skill",
                    "config": {"description": "Style rules.", "body": "Use ruff."}}]


# ---------------------------------------------------------------- refused answers


BAD = [
    ("not json", "I would improve the run-tests skill.", "the answer is not JSON: it holds no {...} object"),
    ("truncated json", '{"summary": "x", "decisions": [', "the answer is not JSON: "),
    ("two objects", '{"summary": "a", "decisions": []}\n{"summary": "b", "decisions": []}',
     "the answer is not JSON: Extra data"),
    ("a list", "[]", "the answer is JSON but not an object (a list)"),
    ("no decisions", '{"summary": "x"}', "answer: 'decisions' is a required property"),
    ("extra key", '{"summary": "x", "decisions": [], "mood": "good"}',
     "answer: Additional properties are not allowed ('mood' was unexpected)"),
    ("unknown action", answer(decision("run-tests", "delete_skill")),
     "answer.decisions[0].action: unknown action 'delete_skill' (expected improve_skill, optimize_description, "
     "create_skill, skip)"),
    ("no reason", answer({"skill": "run-tests", "action": "skip"}),
     "answer.decisions[0]: 'reason' is a required property"),
    ("path escape", answer(decision("../x", "create_skill", description="d", body="b")),
     "decisions[0].skill: '../x' is a path, not a skill name (it would escape skills/)"),
    ("nested path", answer(decision("a/b", "create_skill", description="d", body="b")),
     "decisions[0].skill: 'a/b' is a path, not a skill name"),
    ("absolute path", answer(decision("/etc/passwd", "improve_skill", body="b")),
     "decisions[0].skill: '/etc/passwd' is a path, not a skill name"),
    ("bad name", answer(decision("Run Tests", "create_skill", description="d", body="b")),
     "decisions[0].skill: invalid skill name 'Run Tests' (must match ^[a-z0-9][a-z0-9_-]{0,63}$)"),
    ("trailing newline name", answer(decision("x\n", "create_skill", description="d", body="b")),
     "decisions[0].skill: invalid skill name 'x\\n'"),
    ("oversize body", answer(decision("run-tests", "improve_skill", body="é" * 60)),
     "decisions[0].body: 120 bytes, over max_skill_bytes 100"),
    ("empty body", answer(decision("run-tests", "improve_skill", body=" \n\n ")), "decisions[0].body: empty body"),
    ("empty create body", answer(decision("new", "create_skill", description="d", body="")),
     "decisions[0].body: empty body"),
    ("no body", answer(decision("run-tests", "improve_skill", description="d")),
     "decisions[0]: improve_skill 'run-tests' needs a body"),
    ("create without description", answer(decision("new", "create_skill", body="b")),
     "decisions[0]: create_skill 'new' needs a description and a body"),
    ("multiline description", answer(decision("run-tests", "optimize_description", description="Run.\nAlso lint.")),
     "decisions[0].description: multi-line description (it must be one line)"),
    ("empty description", answer(decision("run-tests", "optimize_description", description="  ")),
     "decisions[0].description: empty description"),
    ("optimize with a body", answer(decision("run-tests", "optimize_description", description="d", body="b")),
     "decisions[0]: optimize_description changes only the description; drop 'body' or use improve_skill"),
    ("improve a missing skill", answer(decision("deploy", "improve_skill", body="b")),
     "decisions[0]: improve_skill 'deploy': no such skill in the pool (create_skill makes new ones)"),
    ("optimize a missing skill", answer(decision("deploy", "optimize_description", description="d")),
     "decisions[0]: optimize_description 'deploy': no such skill in the pool"),
    ("create an existing skill", answer(decision("style", "create_skill", description="d", body="b")),
     "decisions[0]: create_skill 'style': the skill already exists (improve_skill it)"),
    ("too many edits", answer(*(decision(f"s{i}", "create_skill", description="d", body="b") for i in range(3)),
                              decision("style", "skip")),
     "the answer makes 3 edits; max_edits is 2"),
    ("duplicate skill", answer(decision("style", "optimize_description", description="d"),
                               decision("style", "improve_skill", body="b")),
     "decisions[1].skill: duplicate skill 'style' (decisions[0] names it too; one decision per skill)"),
    ("truncated body copied back", answer(decision("run-tests", "improve_skill",
                                                   body="a\n[... 900 characters not shown ...]\nb")),
     "decisions[0].body: holds the prompt's 'characters not shown' mark"),
    ("front matter in body", answer(decision("run-tests", "improve_skill", body="---\nname: x\n---\nbody")),
     "decisions[0].body: starts with front matter"),
]


@pytest.mark.parametrize("text,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_or_unsafe_answers_are_refused_with_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(RecipeError) as exc:
        recipe(max_skill_bytes=100, max_edits=2).edit(text, pool())
    assert str(exc.value).startswith(message), str(exc.value)
    assert "\n" not in str(exc.value)


def test_harness_limits_become_recipe_errors() -> None:
    """What only the harness checks (here: a NUL byte in a body) is refused as a RecipeError too."""
    with pytest.raises(RecipeError, match=r"^the edits do not apply to the harness: mutation 0 \(update skill "
                                          r"run-tests\): body contains a NUL character$"):
        recipe().edit(answer(decision("run-tests", "improve_skill", body="a\x00b")), pool())


# ---------------------------------------------------------------- the README's scenario


def test_readme_scenario_composes(tmp_path: Path) -> None:
    text = (ROOT / "recipes" / "skillclaw" / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL) if b.startswith("# scenarios/coder"))
    scen = make_scenarios(tmp_path / "s", names=(), extra={"coder": block})
    pool().render(scen / "coder" / "harness")
    (scen / "coder" / "tasks.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    cfg = config.compose(scen / "coder.yaml")
    assert (cfg.recipe.name, cfg.gate["kind"], cfg.gate["min_win_margin"], cfg.harness.dir) == (
        "skillclaw", "paired", 0, "coder/harness")
    r = build(cfg.recipe.name, cfg.recipe.params)
    assert isinstance(r, SkillClaw) and (r.cfg.batch_size, r.cfg.max_edits, r.cfg.low_score) == (8, 2, 0.5)
