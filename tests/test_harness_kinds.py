"""Roles and extensions in the harness tree (reefd/harness/declared.py): a folder with both loads and renders back
byte for byte; every mistake in one (a key the schema does not know, a program that is not a command the user has,
a hook on no event) is refused naming the file or the mutation, and the reason. Neither is injected into prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reefd.harness import Harness, HarnessError

ROLE = "---\nname: reviewer\ndescription: Reviews a diff before it is committed.\ntools:\n- Read\n- Grep\n---\n\n" \
       "Read the diff. Name each problem with its file and line.\n"
MCP = "command:\n- uvx\n- mcp-server-git\nenv:\n  GIT_DIR: .git\ntype: mcp\n"
HOOK = "command:\n- ruff\n- check\nevent: PostToolUse\nmatcher: Edit\ntype: hook\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_roles_and_extensions_load_and_render_back_byte_for_byte(tmp_path: Path) -> None:
    files = {"roles/reviewer.md": ROLE, "extensions/git.yaml": MCP, "extensions/lint.yaml": HOOK,
             "extensions/docs.yaml": "type: mcp\nurl: https://mcp.example.com/sse\n", "rules/style.md": "Be brief.\n"}
    h = Harness.from_dir(tree(tmp_path / "h", files))
    role = h[("role", "reviewer")]
    assert dict(role.config) == {"description": "Reviews a diff before it is committed.", "tools": ("Read", "Grep"),
                                 "body": "Read the diff. Name each problem with its file and line."}
    assert h[("extension", "git")].config["command"] == ("uvx", "mcp-server-git")
    assert {p: d.decode() for p, d in h.files().items()} == files
    again = Harness.from_dir(h.render(tmp_path / "again"))
    assert again == h and again.files() == h.files()
    assert h.prompt_block() == "# Harness\n\n## Rules\n\nBe brief.\n"  # an agent loads these; no prompt says them
    no_tools = Harness.from_dir(tree(tmp_path / "n", {"roles/helper.md": "---\nname: helper\ndescription: Helps.\n"
                                                                         "---\n\nHelp.\n"}))
    assert "tools" not in no_tools[("role", "helper")].config  # every tool, as in the agents' own formats


@pytest.mark.parametrize("rel,text,reason", [
    ("roles/reviewer.md", ROLE.replace("name: reviewer", "name: other"), "name other does not match its file reviewer"),
    ("roles/reviewer.md", "---\nname: reviewer\n---\n\nx\n", "front matter needs 'description'"),
    ("roles/reviewer.md", ROLE.replace("tools:", "model: big\ntools:"), "unknown front matter key model"),
    ("roles/reviewer.md", ROLE.replace("- Grep", "- rm -rf"), "tools.1: 'rm -rf' does not match"),
    ("extensions/git.yaml", MCP + "script: curl x | sh\n", "Additional properties are not allowed ('script'"),
    ("extensions/git.yaml", MCP + "url: https://x\n", "is valid under each of"),
    ("extensions/git.yaml", MCP.replace("- uvx", "- ./bin/server"), "command.0: './bin/server' does not match"),
    ("extensions/git.yaml", "type: mcp\nurl: ftp://x\n", "url: 'ftp://x' does not match"),
    ("extensions/git.yaml", "type: plugin\ncommand: [x]\n", "type: 'plugin' is not one of ['mcp', 'hook']"),
    ("extensions/lint.yaml", HOOK.replace("PostToolUse", "OnSave"), "event: 'OnSave' is not one of"),
    ("extensions/lint.yaml", HOOK.replace("command:\n- ruff\n- check\n", ""), "'command' is required"),
    ("extensions/lint.yaml", "- a list\n", "must be a YAML mapping, got list"),
    ("extensions/Lint.yaml", HOOK, "unexpected; extensions/ holds <id>.yaml files"),
])
def test_a_bad_role_or_extension_is_refused_naming_the_file_and_the_reason(tmp_path: Path, rel: str, text: str,
                                                                           reason: str) -> None:
    root = tree(tmp_path / "h", {rel: text})
    with pytest.raises(HarnessError) as exc:
        Harness.from_dir(root)
    assert exc.value.where == str(root / rel) and reason in exc.value.reason, exc.value


def extension(**config: Any) -> dict[str, Any]:
    return {"op": "create", "kind": "extension", "id": "git", "config": config}


def test_mutations_create_update_and_remove_every_kind_in_one_shape(tmp_path: Path) -> None:
    base = Harness.from_dir(tree(tmp_path / "h", {"rules/style.md": "Be brief.\n"}))
    grown = base.apply([
        extension(type="mcp", command=["uvx", "mcp-server-git"]),
        {"op": "create", "kind": "role", "id": "reviewer", "config": {"description": "Reviews.", "body": "Review."}},
        {"op": "create", "kind": "prompt", "id": "lead", "config": {"body": "Start plainly."}},
    ])
    assert sorted(grown.files()) == ["extensions/git.yaml", "prompts/lead.md", "roles/reviewer.md", "rules/style.md"]
    changed = grown.apply([{"op": "update", "kind": "role", "id": "reviewer",
                            "config": {"description": "Reviews.", "body": "Review twice.", "tools": ["Read"]}},
                           {"op": "remove", "kind": "extension", "id": "git"}])
    assert changed[("role", "reviewer")].config["tools"] == ("Read",) and ("extension", "git") not in changed
    assert changed.summary(grown) == "update role reviewer; remove extension git"
    with pytest.raises(HarnessError) as exc:
        base.apply([extension(type="mcp", command=["uvx"], binary="AAAA")])
    assert str(exc.value).startswith("mutation 0 (create extension git): Additional properties are not allowed")
