"""The harness tree model against real temporary folders: parsing, exact rendering, limits, atomic mutations."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from reefd.harness import (
    MAX_BODY_BYTES,
    MAX_DESCRIPTION_CHARS,
    MAX_ENTRIES,
    Entry,
    Harness,
    HarnessError,
)

SKILL = (
    b"---\nname: git-hygiene\ndescription: Use when committing or opening a pull request\n---\n\n"
    b"1. Stage related changes.\n2. Write an imperative subject.\n"
)
CONFIG = b"model: reef\npermissions:\n  allow:\n  - git status\n  - ls\nretries: 2\n"


def sample() -> Harness:
    return Harness(
        [
            Entry("style", "rules", {"body": "Use four spaces.\n\nNever commit secrets."}),
            Entry("tests", "rules", {"body": "Run the tests before you finish."}),
            Entry(
                "git-hygiene",
                "skill",
                {
                    "description": "Use when committing or opening a pull request",
                    "body": "1. Stage related changes.\n2. Write an imperative subject.",
                },
            ),
            Entry("review", "prompt", {"body": "Review the diff for bugs."}),
            Entry("config", "config", {"model": "reef", "retries": 2, "permissions": {"allow": ["git status", "ls"]}}),
        ]
    )


def write(root: Path, files: dict[str, bytes | str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return root


def error(match: str) -> Any:
    return pytest.raises(HarnessError, match=re.escape(match))


def create(kind: str, ident: str, **config: Any) -> dict[str, Any]:
    return {"op": "create", "kind": kind, "id": ident, "config": config}


# -- files and round trips


def test_rendered_bytes_for_each_kind() -> None:
    assert sample().files() == {
        "config.yaml": CONFIG,
        "prompts/review.md": b"Review the diff for bugs.\n",
        "rules/style.md": b"Use four spaces.\n\nNever commit secrets.\n",
        "rules/tests.md": b"Run the tests before you finish.\n",
        "skills/git-hygiene/SKILL.md": SKILL,
    }
    assert list(sample().files()) == sorted(sample().files())


def test_round_trip_through_a_folder(tmp_path: Path) -> None:
    h = sample()
    root = h.render(tmp_path / "harness")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(h.files())
    again = Harness.from_dir(root)
    assert again == h
    assert again.files() == h.files()
    assert Harness.from_dir(again.render(tmp_path / "second")).files() == h.files()


def test_round_trip_through_json() -> None:
    h = sample()
    data = h.to_json()
    assert data[0] == {"id": "style", "kind": "rules", "config": {"body": "Use four spaces.\n\nNever commit secrets."}}
    assert data[-1]["config"] == {"model": "reef", "retries": 2, "permissions": {"allow": ["git status", "ls"]}}
    assert Harness.from_json(data) == h
    assert [(e["kind"], e["id"]) for e in data] == list(h)


def test_bodies_are_canonical(tmp_path: Path) -> None:
    entry = Entry("style", "rules", {"body": "\n\nline one\r\nline two\rend  \n\n\n"})
    assert entry.config == {"body": "line one\nline two\nend  "}
    assert entry.file == b"line one\nline two\nend  \n"
    assert entry == Entry("style", "rules", {"body": "line one\nline two\nend  "})
    root = write(tmp_path / "h", {"rules/style.md": b"line one\r\nline two\r\nend  \r\n\r\n"})
    assert Harness.from_dir(root)[("rules", "style")] == entry


def test_front_matter_is_quoted_when_yaml_needs_it(tmp_path: Path) -> None:
    h = Harness(
        [
            Entry("2024-01-01", "skill", {"description": "  Use when: dates # matter  ", "body": "b"}),
            Entry("true", "skill", {"description": "Emoji 😀 and 'quotes'", "body": "b"}),
        ]
    )
    assert h[("skill", "2024-01-01")].file == (
        b"---\nname: '2024-01-01'\ndescription: 'Use when: dates # matter'\n---\n\nb\n"
    )
    assert h[("skill", "true")].config["description"] == "Emoji 😀 and 'quotes'"
    assert Harness.from_dir(h.render(tmp_path / "h")) == h


def test_hand_written_skill_without_blank_line(tmp_path: Path) -> None:
    root = write(tmp_path / "h", {"skills/x/SKILL.md": "---\ndescription: d\nname: x\n---\nbody\n"})
    assert Harness.from_dir(root).files() == {"skills/x/SKILL.md": b"---\nname: x\ndescription: d\n---\n\nbody\n"}


def test_empty_folder_readme_and_empty_harness(tmp_path: Path) -> None:
    assert Harness.from_dir(write(tmp_path / "empty", {})) == Harness()
    root = write(tmp_path / "h", {"README.md": "# About\n", "rules/a.md": "A"})
    assert Harness.from_dir(root).files() == {"rules/a.md": b"A\n"}
    assert Harness().files() == {}
    assert Harness().render(tmp_path / "out").is_dir()
    assert Harness.from_dir(tmp_path / "out") == Harness()


def test_render_needs_an_empty_folder(tmp_path: Path) -> None:
    write(tmp_path / "full", {"x": "x"})
    with error(f"{tmp_path / 'full'}: render needs a missing or empty folder"):
        sample().render(tmp_path / "full")
    (tmp_path / "empty").mkdir()
    assert Harness.from_dir(sample().render(tmp_path / "empty")) == sample()


def test_entries_are_frozen() -> None:
    entry = sample()[("config", "config")]
    with pytest.raises(TypeError):
        entry.config["model"] = "other"  # type: ignore[index]
    with pytest.raises(TypeError):
        entry.config["permissions"]["allow"] = []
    assert hash(entry) == hash(Entry("config", "config", {}))
    assert sample().of_kind("rules")[1].id == "tests"


# -- validation


@pytest.mark.parametrize("ident", ["../x", "a/b", "A", "a\x00", "", "-a", "_a", "a.b", "a" * 65, "x\n", "é", 3])
def test_bad_ids(ident: Any) -> None:
    with pytest.raises(HarnessError, match=r"^rules .*: (invalid id|id )") as caught:
        Entry(ident, "rules", {"body": "b"})
    assert "\n" not in str(caught.value)
    with pytest.raises(HarnessError, match=r"^mutation 0 \(create rules .*\): (invalid id|id )"):
        Harness().apply([create("rules", ident, body="b")])


def test_good_ids() -> None:
    for ident in ["a", "0", "a" * 64, "git-hygiene", "snake_case-9"]:
        assert Entry(ident, "prompt", {"body": "b"}).path == f"prompts/{ident}.md"


def test_body_limits() -> None:
    assert Entry("x", "rules", {"body": "é" * (MAX_BODY_BYTES // 2)}).file.endswith("é\n".encode())
    with error(f"rules x: body is {MAX_BODY_BYTES + 1} bytes (limit {MAX_BODY_BYTES})"):
        Entry("x", "rules", {"body": "a" * (MAX_BODY_BYTES + 1)})
    for body in ["", "\n\n", " \n\t "]:
        with error("prompt x: body is empty"):
            Entry("x", "prompt", {"body": body})
    with error("rules x: body contains a NUL character"):
        Entry("x", "rules", {"body": "a\x00b"})
    with error("rules x: body must be a string, got int"):
        Entry("x", "rules", {"body": 1})
    with error("rules x: body is not valid UTF-8"):
        Entry("x", "rules", {"body": "\udc80"})


def test_description_limits() -> None:
    assert Entry("x", "skill", {"description": "d" * MAX_DESCRIPTION_CHARS, "body": "b"})
    with error(f"skill x: description is {MAX_DESCRIPTION_CHARS + 1} characters (limit {MAX_DESCRIPTION_CHARS})"):
        Entry("x", "skill", {"description": "d" * (MAX_DESCRIPTION_CHARS + 1), "body": "b"})
    for text in ["one\ntwo", "one\r\ntwo", "one\u2028two"]:
        with error("skill x: description must be one line"):
            Entry("x", "skill", {"description": text, "body": "b"})
    with error("skill x: description is empty"):
        Entry("x", "skill", {"description": "  ", "body": "b"})


def test_config_shapes() -> None:
    with error("skill x: config needs 'description'"):
        Entry("x", "skill", {"body": "b"})
    with error("rules x: unknown config key description (expected body)"):
        Entry("x", "rules", {"body": "b", "description": "d"})
    with error("rules x: config must be a mapping, got list"):
        Entry("x", "rules", ["b"])  # type: ignore[arg-type]
    with error("config settings: the config entry's id must be 'config'"):
        Entry("settings", "config", {})
    with error("tool x: unknown kind tool (expected rules|skill|prompt|role|extension|config)"):
        Entry("x", "tool", {})
    with error("config config: config.a[1]: nan is not a finite number"):
        Entry("config", "config", {"a": [1, float("nan")]})
    with error("config config: config.a: key 1 is not a string"):
        Entry("config", "config", {"a": {1: 2}})
    with error("config config: config.when: unsupported value of type set"):
        Entry("config", "config", {"when": {1}})
    with error("config config: config.a contains a NUL character"):
        Entry("config", "config", {"a": "\x00"})
    deep: dict[str, Any] = {}
    for _ in range(40):
        deep = {"d": deep}
    with pytest.raises(HarnessError, match="nested deeper than 32 levels"):
        Entry("config", "config", deep)


def test_harness_limits() -> None:
    many = [Entry(f"r{i}", "rules", {"body": "b"}) for i in range(MAX_ENTRIES + 1)]
    assert len(Harness(many[:-1])) == MAX_ENTRIES
    with error(f"harness: {MAX_ENTRIES + 1} entries (limit {MAX_ENTRIES})"):
        Harness(many)
    big = [Entry(f"r{i}", "rules", {"body": "a" * MAX_BODY_BYTES}) for i in range(16)]
    assert len(Harness(big[:15])) == 15
    with error(f"harness: rendered files total {16 * (MAX_BODY_BYTES + 1)} bytes (limit {1024 * 1024})"):
        Harness(big)
    with error("harness: duplicate rules r0"):
        Harness([many[0], many[0]])


# -- reading folders


@pytest.mark.parametrize(
    ("files", "where", "reason"),
    [
        ({"notes.txt": "x"}, "notes.txt", "unexpected; a harness holds"),
        ({".hidden": "x"}, ".hidden", "unexpected; a harness holds"),
        ({"docs/README.md": "x"}, "docs", "unexpected; a harness holds"),
        ({"rules/x.txt": "x"}, "rules/x.txt", "unexpected; rules/ holds <id>.md files"),
        ({"rules/Style.md": "x"}, "rules/Style.md", "unexpected; rules/ holds <id>.md files"),
        ({"rules/deep/x.md": "x"}, "rules/deep", "unexpected; rules/ holds <id>.md files"),
        ({"prompts/.md": "x"}, "prompts/.md", "unexpected; prompts/ holds <id>.md files"),
        ({"skills/x.md": "x"}, "skills/x.md", "unexpected; skills/ holds <id>/ folders"),
        (
            {"skills/x/SKILL.md": "---\nname: x\ndescription: d\n---\nb", "skills/x/run.sh": "x"},
            "skills/x/run.sh",
            "unexpected; only SKILL.md",
        ),
        ({"skills/x/skill.md": "x"}, "skills/x/skill.md", "unexpected; only SKILL.md"),
        (
            {"skills/x/SKILL.md": "---\nname: y\ndescription: d\n---\nb"},
            "skills/x/SKILL.md",
            "name y does not match its folder x",
        ),
        ({"skills/x/SKILL.md": "---\nname: x\n---\nb"}, "skills/x/SKILL.md", "front matter needs 'description'"),
        (
            {"skills/x/SKILL.md": "---\nname: x\ndescription: d\nlicense: MIT\n---\nb"},
            "skills/x/SKILL.md",
            "unknown front matter key license",
        ),
        (
            {"skills/x/SKILL.md": "---\nname: x\ndescription: |\n  one\n  two\n---\nb"},
            "skills/x/SKILL.md",
            "description must be one line",
        ),
        (
            {"skills/x/SKILL.md": "---\nname: x\ndescription: 3\n---\nb"},
            "skills/x/SKILL.md",
            "description must be a string, got int",
        ),
        ({"skills/x/SKILL.md": "---\nname: x\ndescription: d\n---\n\n"}, "skills/x/SKILL.md", "body is empty"),
        ({"skills/x/SKILL.md": "name: x\n"}, "skills/x/SKILL.md", "must start with a '---' line"),
        ({"skills/x/SKILL.md": "---\nname: x\n"}, "skills/x/SKILL.md", "front matter has no closing '---' line"),
        ({"skills/x/SKILL.md": "---\nname: [x\n---\nb"}, "skills/x/SKILL.md", "invalid YAML: while parsing"),
        ({"rules/x.md": ""}, "rules/x.md", "body is empty"),
        ({"rules/x.md": b"a\x00b"}, "rules/x.md", "contains a NUL character"),
        ({"rules/x.md": b"a\xffb"}, "rules/x.md", "not valid UTF-8 at byte 1"),
        ({"rules/x.md": "a" * (MAX_BODY_BYTES + 1)}, "rules/x.md", f"body is {MAX_BODY_BYTES + 1} bytes"),
        ({"config.yaml": "- a\n"}, "config.yaml", "must be a YAML mapping, got list"),
        ({"config.yaml": ""}, "config.yaml", "must be a YAML mapping, got NoneType"),
        ({"config.yaml": "when: 2024-01-01\n"}, "config.yaml", "config.when: unsupported value of type date"),
    ],
)
def test_bad_folders(tmp_path: Path, files: dict[str, bytes | str], where: str, reason: str) -> None:
    root = write(tmp_path / "h", files)
    with pytest.raises(HarnessError) as caught:
        Harness.from_dir(root)
    assert caught.value.where == str(root / where)
    assert caught.value.reason.startswith(reason)
    assert "\n" not in str(caught.value)


def test_missing_skill_file_and_missing_folder(tmp_path: Path) -> None:
    (tmp_path / "h" / "skills" / "x").mkdir(parents=True)
    with error(f"{tmp_path / 'h' / 'skills' / 'x'}: missing SKILL.md"):
        Harness.from_dir(tmp_path / "h")
    with error(f"{tmp_path / 'nope'}: not a folder"):
        Harness.from_dir(tmp_path / "nope")


@pytest.mark.parametrize("link", ["rules/x.md", "skills/x", "rules", "README.md", "skills/y/SKILL.md"])
def test_symlinks_are_refused(tmp_path: Path, link: str) -> None:
    target = write(tmp_path / "elsewhere", {"x.md": "secret", "SKILL.md": "---\nname: x\ndescription: d\n---\nb"})
    root = tmp_path / "h"
    (root / link).parent.mkdir(parents=True)
    os.symlink(target / "x.md" if link.endswith(".md") else target, root / link)
    with error(f"{root / link}: symlinks are not allowed"):
        Harness.from_dir(root)


def test_harness_limits_name_the_folder(tmp_path: Path) -> None:
    root = write(tmp_path / "h", {f"rules/r{i}.md": "b" for i in range(MAX_ENTRIES + 1)})
    with error(f"{root}: {MAX_ENTRIES + 1} entries (limit {MAX_ENTRIES})"):
        Harness.from_dir(root)


# -- mutations


def test_apply_creates_updates_removes() -> None:
    h = sample()
    after = h.apply(
        [
            create("skill", "debugging", description="Use when a test fails", body="Reproduce first."),
            {"op": "update", "kind": "rules", "id": "style", "config": {"body": "Use tabs."}},
            {"op": "remove", "kind": "prompt", "id": "review"},
            {"op": "update", "kind": "config", "id": "config", "config": {"model": "other"}},
        ]
    )
    assert after[("rules", "style")].config == {"body": "Use tabs."}
    assert after[("config", "config")].config == {"model": "other"}  # replaced, not merged
    assert ("prompt", "review") not in after
    assert after.summary(h) == "create skill debugging; update rules style; update config; remove prompt review"
    assert h == sample()
    assert h.apply([]) == h


def test_apply_runs_in_order_against_the_running_result() -> None:
    after = Harness().apply(
        [create("rules", "a", body="1"), {"op": "update", "kind": "rules", "id": "a", "config": {"body": "2"}}]
    )
    assert after.files() == {"rules/a.md": b"2\n"}
    assert Harness().apply([create("rules", "a", body="1"), {"op": "remove", "kind": "rules", "id": "a"}]) == Harness()


def test_apply_is_atomic_and_names_the_first_bad_mutation() -> None:
    h = sample()
    batch = [
        create("rules", "new", body="x"),
        {"op": "remove", "kind": "prompt", "id": "review"},
        {"op": "update", "kind": "rules", "id": "missing", "config": {"body": "x"}},
        {"op": "create", "kind": "rules", "id": "A", "config": {"body": "x"}},
    ]
    with error("mutation 2 (update rules missing): rules missing does not exist"):
        h.apply(batch)
    assert h == sample()


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (create("rules", "style", body="x"), "mutation 1 (create rules style): rules style already exists"),
        ({"op": "remove", "kind": "skill", "id": "nope"}, "mutation 1 (remove skill nope): skill nope does not exist"),
        (
            {"op": "delete", "kind": "rules", "id": "style"},
            "mutation 1 (delete rules style): unknown op delete (expected create|update|remove)",
        ),
        (
            create("tool", "x", body="x"),
            "mutation 1 (create tool x): unknown kind tool (expected rules|skill|prompt|role|extension|config)",
        ),
        ({"op": "create", "kind": "rules", "id": "x"}, "mutation 1 (create rules x): create needs a config"),
        (
            {"op": "update", "kind": "rules", "id": "style", "config": "x"},
            "mutation 1 (update rules style): config must be a mapping, got str",
        ),
        ({"op": "create", "kind": "rules", "config": {}}, "mutation 1 (create rules): missing id"),
        ({"kind": "rules", "id": "x"}, "mutation 1 (rules x): missing op"),
        ({**create("rules", "x", body="b"), "why": "y"}, "mutation 1 (create rules x): unknown field why"),
        (create("rules", "../x", body="b"), "mutation 1 (create rules '../x'): invalid id '../x'"),
        (
            create("skill", "x", description="a\nb", body="b"),
            "mutation 1 (create skill x): description must be one line",
        ),
        (create("rules", "x", body=""), "mutation 1 (create rules x): body is empty"),
        (create("config", "x", a=1), "mutation 1 (create config x): the config entry's id must be 'config'"),
        ("create rules x", "mutation 1: expected an object, got str"),
    ],
)
def test_bad_mutations(mutation: Any, message: str) -> None:
    with error(message):
        sample().apply([create("rules", "ok", body="fine"), mutation])


def test_apply_checks_the_result_and_its_input() -> None:
    full = Harness([Entry(f"r{i}", "rules", {"body": "b"}) for i in range(MAX_ENTRIES)])
    with error(f"mutations (result): {MAX_ENTRIES + 1} entries (limit {MAX_ENTRIES})"):
        full.apply([create("rules", "one-more", body="b")])
    assert (
        len(full.apply([{"op": "remove", "kind": "rules", "id": "r0"}, create("rules", "one-more", body="b")])) == 200
    )
    with error("mutations: expected a list, got dict"):
        sample().apply({"op": "create"})  # type: ignore[arg-type]


def test_from_json_names_the_entry() -> None:
    with error("entry 1 (rules x): body is empty"):
        Harness.from_json(
            [
                {"id": "a", "kind": "rules", "config": {"body": "a"}},
                {"id": "x", "kind": "rules", "config": {"body": ""}},
            ]
        )
    with error('entry 0: expected an object with exactly "id", "kind" and "config"'):
        Harness.from_json([{"id": "a", "kind": "rules"}])
    with error("entries: expected a list, got str"):
        Harness.from_json("[]")


def test_error_is_a_one_line_value_error() -> None:
    with pytest.raises(ValueError) as caught:
        Entry("x", "rules", {"body": ""})
    err = caught.value
    assert isinstance(err, HarnessError) and (err.where, err.reason) == ("rules x", "body is empty")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) == "rules x: body is empty"


# -- summaries and the prompt block


def test_summary() -> None:
    h = sample()
    assert h.summary(h) == "no changes"
    assert (
        Harness().summary(h)
        == "remove rules style, tests; remove skill git-hygiene; remove prompt review; remove config"
    )
    many = Harness([Entry(f"s{i}", "skill", {"description": "d", "body": "b"}) for i in range(8)])
    assert many.summary(Harness()) == "create skill s0, s1, s2, s3, s4 (+3 more)"


def test_prompt_block() -> None:
    h = sample()
    assert h.prompt_block() == (
        "# Harness\n\n"
        "## Rules\n\n"
        "Use four spaces.\n\nNever commit secrets.\n\n"
        "Run the tests before you finish.\n\n"
        "## Skills\n\n"
        "- git-hygiene: Use when committing or opening a pull request\n"
    )
    assert h.prompt_block(inline_skills=True).endswith(
        "## Skills\n\n### git-hygiene\n\nUse when committing or opening a pull request\n\n"
        "1. Stage related changes.\n2. Write an imperative subject.\n"
    )
    assert Harness().prompt_block() == ""
    assert Harness([Entry("review", "prompt", {"body": "b"})]).prompt_block() == ""
    rules_only = Harness([Entry("a", "rules", {"body": "Be brief."})])
    assert rules_only.prompt_block(inline_skills=True) == "# Harness\n\n## Rules\n\nBe brief.\n"


def test_the_applied_prompt_opens_the_block() -> None:
    """The scenario's harness.prompt: that prompt's body first, then the rules and skills; a prompt the harness
    does not hold adds nothing."""
    h = sample()
    review = h[("prompt", "review")].config["body"]
    assert h.prompt_block(prompt="review") == f"{review}\n\n" + h.prompt_block()
    assert h.prompt_block(prompt="missing") == h.prompt_block()
    alone = Harness([Entry("lead", "prompt", {"body": "Start plainly."})])
    assert alone.prompt_block(prompt="lead") == "Start plainly.\n" and alone.prompt_block() == ""
