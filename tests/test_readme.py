"""The README and the guides execute: their `sh` blocks, run as written against a real reefd, and their scenario
files, composed.

A fenced block marked `sh` is a promise that its commands work as written against the daemon of the README's
quick start; blocks without the mark (```, ```bash, ```yaml) show shapes, synopses or commands for other
machines. Only the address and the model differ here: the daemon listens on a free port, and its scenarios run
the tiny model so the suite stays fast (the shipped scenario files are composed in tests/test_config.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson
import pytest

from reefd import config
from tests.conftest import ROOT, Daemon, make_scenarios

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HELLO = "defaults:\n  - model: tiny\n  - _self_\nserve:\n  default_max_tokens: 8\n"
RELEASE = re.compile(r"\br\d+-[0-9a-f]{7}\b")
FRAGMENT_BASE = "defaults:\n  - model: tiny\n  - recipe: sao\n  - _self_\n"


def sh_blocks(page: Path) -> list[str]:
    """The page's ```sh blocks, in order."""
    return re.findall(r"^```sh\n(.*?)^```", page.read_text(), re.M | re.S)


def commands(block: str) -> list[str]:
    """One command per line, continuation lines joined."""
    return [cmd.strip() for cmd in block.replace("\\\n", " ").splitlines() if cmd.strip()]


def quick_start_commands() -> list[str]:
    block = next(b for b in sh_blocks(ROOT / "README.md") if "curl -s localhost:8900/v1/chat/completions" in b)
    return commands(block)


def guide_commands() -> list[tuple[str, str]]:
    """(page, command) for every `sh` block of the README and the guides, the quick start's aside (it has a test
    of its own)."""
    quick = quick_start_commands()
    return [(page.name, cmd) for page in PAGES for block in sh_blocks(page) for cmd in commands(block)
            if cmd not in quick]


def run_as_written(cmd: str, d: Daemon, env: dict[str, str], cwd: Path, receipt: str, release: str
                   ) -> subprocess.CompletedProcess[str]:
    cmd = cmd.replace("localhost:8900", f"127.0.0.1:{d.port}").replace("<receipt>", receipt)
    cmd = cmd.replace("<release>", release)
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def environment(d: Daemon, home: Path) -> dict[str, str]:
    """What a user of the quick start has: the token, reefctl on the PATH; the state folder and home of this
    test, so nothing a command writes leaves it."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "REEF_TOKEN": d.token, "REEF_URL": d.url, "REEF_STATE": str(d.state), "HOME": str(home),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def test_quick_start_commands_work_as_written(tmp_path: Path) -> None:
    d = Daemon(scenarios=make_scenarios(tmp_path / "s", names=(), extra={"hello": HELLO}),
               state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    env = environment(d, tmp_path / "home")
    commands_ = quick_start_commands()
    assert [c.split()[0] for c in commands_] == ["curl", "curl", "reefctl", "reefctl"]
    outputs = []
    receipt = ""
    try:
        for cmd in commands_:
            out = run_as_written(cmd, d, env, tmp_path, receipt, "")
            assert out.returncode == 0, (cmd, out.stderr)
            outputs.append(out.stdout)
            found = re.search(r"x-reef-agent-record-id: (\S+)", out.stdout)
            receipt = receipt or (found.group(1) if found else "")
    finally:
        d.stop()
    assert receipt and '"object": "chat.completion"' in outputs[0].replace('":"', '": "')
    assert f'"references":["{receipt}"]' in outputs[1].replace(" ", "")
    assert re.search(r"^hello\s+tiny\s+worker\s+ready\s+0/8\+0\s+r0-[0-9a-f]{7}\s+1\s+1", outputs[2], re.M)
    assert re.search(rf"^{receipt}\s+\S+\s+openai\.chat_completions\s+\S+\s+1\s", outputs[3], re.M)


def harness_scenarios(dst: Path) -> Path:
    """The quick start's `hello` and the shipped `coder` harness scenario, both on the tiny model (make_scenarios
    copies the folders beside the scenario files: the config groups and coder-harness)."""
    coder = (ROOT / "scenarios" / "coder.yaml").read_text().replace("model: smollm2", "model: tiny")
    scenarios = make_scenarios(dst, names=(), extra={"hello": HELLO, "coder": coder})
    shutil.copy(ROOT / "scenarios" / "coder-tasks.jsonl", scenarios)
    return scenarios


def first_receipt(d: Daemon) -> str:
    body = orjson.dumps({"model": "hello", "messages": [{"role": "user", "content": "Say hi"}]})
    req = urllib.request.Request(f"{d.url}/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {d.token}", "x-reef-scenario": "hello", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as answer:
        return str(answer.headers["x-reef-agent-record-id"])


def test_the_guides_commands_work_as_written(tmp_path: Path) -> None:
    todo = guide_commands()
    pages = {page for page, _ in todo}
    assert len(todo) >= 10 and len(pages) >= 4, f"too few `sh` commands in the guides ({len(todo)} in {pages})"
    d = Daemon(scenarios=harness_scenarios(tmp_path / "s"), state=tmp_path / "state",
               log_path=tmp_path / "reefd.log")
    d.start()
    env = environment(d, tmp_path / "home")
    failures = []
    try:
        receipt = first_receipt(d)
        release = ""
        for page, cmd in todo:
            out = run_as_written(cmd, d, env, ROOT, receipt, release)
            if out.returncode != 0:
                failures.append(f"{page}: {cmd}\n  exit {out.returncode}: {out.stderr.strip()[-600:]}")
            found = RELEASE.search(out.stdout)
            release = release or (found.group(0) if found else "")
    finally:
        d.stop()
    assert not failures, "guide commands that do not work as written:\n" + "\n".join(failures)
    if any("install?adapter=claude" in cmd for _, cmd in todo):  # the harness guide's installer, into this home
        assert "<!-- reef" in (tmp_path / "home" / ".claude" / "CLAUDE.md").read_text()


def scenario_blocks() -> list[tuple[str, str, str]]:
    """(page, file name, text) of every ```yaml block of the README and the guides, as a scenario file: a block
    with `defaults:` is a whole file (named by its `# scenarios/NAME.yaml` line, if it has one); a block named
    `# scenarios/GROUP/NAME.yaml` is an option of a config group, composed into a scenario that picks it; any other
    is a part of one, composed on top of the tiny model and the sao recipe."""
    found = []
    for page in PAGES:
        for i, block in enumerate(re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.M | re.S)):
            named = re.match(r"# scenarios/((?:[\w-]+/)?[\w-]+\.yaml)\n", block)
            name = named.group(1) if named else f"{page.stem}-{i}.yaml"
            whole = re.search(r"^defaults:", block, re.M) or "/" in name
            found.append((page.name, name, block if whole else FRAGMENT_BASE + block))
    return found


@pytest.mark.parametrize(("page", "name", "text"), scenario_blocks(),
                         ids=[f"{page}:{name}" for page, name, _ in scenario_blocks()])
def test_every_scenario_file_the_guides_show_composes(tmp_path: Path, page: str, name: str, text: str) -> None:
    group, _, option = name.removesuffix(".yaml").rpartition("/")
    option_text = text.replace("/opt/vllm/bin/python", sys.executable)  # the guide's GPU host: this test's Python
    if group:  # a config group's option, composed into a scenario that picks it
        picks = {"model": "tiny", "recipe": "sao", group: option}
        text = "defaults:\n" + "".join(f"  - {g}: {o}\n" for g, o in picks.items()) + "  - _self_\n"
    scenarios = make_scenarios(tmp_path / "s", names=(), extra={option: text})
    if group:
        (scenarios / group / f"{option}.yaml").write_text(option_text)
    for shipped in (ROOT / "scenarios").glob("*.jsonl"):  # the shipped sets (code.yaml's is a code practice set)
        shutil.copy(shipped, scenarios)
    for tasks in re.findall(r"tasks: ([\w.-]+\.jsonl)", text):  # a tasks file of the reader's own, 16 tasks
        if not (scenarios / tasks).exists():
            (scenarios / tasks).write_text("".join(
                orjson.dumps({"prompt": f"Capital of country {i}?", "answer": f"City {i}"}).decode() + "\n"
                for i in range(16)))
    config.load_all(scenarios)


def test_the_readme_shows_a_scenario_to_copy() -> None:
    """One that learns from reports, one that learns from practice alone, and one that learns per user."""
    assert {name for page, name, _ in scenario_blocks() if page == "README.md"} == {"learn.yaml", "add.yaml",
                                                                                   "assist.yaml"}
    assert len(scenario_blocks()) >= 10, "too few scenario files in the guides: is the extraction broken?"
