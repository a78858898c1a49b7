"""A scenario's `practice:` settings, composed as reefd loads them: a usable practice set and verifier load, and
every mistake is refused at load in one line naming the file (and the task's line, or the key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reefd import config
from reefd.commit import trials
from reefd.config import CanaryConfig
from tests.conftest import ROOT, make_scenarios

GOOD = '{"prompt": "2 + 3 =", "answer": "5"}\n{"prompt": [{"role": "user", "content": "1 + 1 ="}]}\n'
CODE = '{"prompt": "Write add(a, b).", "entry": "add", "tests": [{"args": [1, 2], "expected": 3}]}\n'


def scenario(tmp_path: Path, practice: str, tasks: str = GOOD) -> Path:
    scen = make_scenarios(tmp_path / "s", names=(), extra={
        "p": f"defaults:\n  - model: tiny\n  - _self_\npractice:\n{practice}"})
    (scen / "tasks.jsonl").write_text(tasks)
    (tmp_path / "outside.jsonl").write_text(tasks)
    return scen / "p.yaml"


def test_a_practice_set_and_its_verifier_load(tmp_path: Path) -> None:
    cfg = config.compose(scenario(tmp_path, "  tasks: tasks.jsonl\n  verifier:\n    command: [sh, -c, 'exit 0']\n"
                                            "    timeout_s: 2\n  samples: 4\n  max_waiting: 8\n  preempt: false\n"))
    assert cfg.practice.tasks == "tasks.jsonl" and cfg.practice.samples == 4
    assert cfg.practice.max_waiting == 8 and cfg.practice.preempt is False
    assert cfg.practice.verifier.command == ["sh", "-c", "exit 0"] and cfg.practice.verifier.timeout_s == 2
    assert config.compose(scenario(tmp_path / "none", "  tasks: null\n")).practice.tasks is None
    code = config.compose(scenario(tmp_path / "code", "  tasks: tasks.jsonl\n  verifier: {code: python}\n", CODE))
    assert code.practice.verifier.code == "python" and code.practice.verifier.command is None


@pytest.mark.parametrize(("practice", "tasks", "message"), [
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n", GOOD + "{not json\n", r"tasks\.jsonl:3: not valid JSON"),
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n", '{"answer": 1}\n', r"tasks\.jsonl:1: missing 'prompt'"),
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n", "\n", r"tasks\.jsonl: no tasks"),
    ("  tasks: missing.jsonl\n  verifier: {command: 'true'}\n", GOOD, r"missing\.jsonl: tasks file not found"),
    ("  tasks: tasks.jsonl\n", GOOD, r"practice\.verifier: set exactly one of command, function and code"),
    ("  tasks: tasks.jsonl\n  verifier: {code: ruby}\n", CODE, r"practice\.verifier\.code: 'ruby' is not one of"),
    ("  tasks: tasks.jsonl\n  verifier: {code: python}\n", GOOD, r"tasks\.jsonl:1: missing 'entry'"),
    ("  tasks: tasks.jsonl\n  verifier: {code: python}\n", CODE.replace('"add"', '"2add"'),
     r"tasks\.jsonl:1: 'entry' must be the name of the Python function to call"),
    ("  tasks: tasks.jsonl\n  verifier: {code: python}\n", CODE.replace('"expected"', '"expect"'),
     r"tasks\.jsonl:1: tests\[0\] must be an object with 'expected'"),
    ("  tasks: tasks.jsonl\n  verifier: {code: python}\n", CODE.replace('"args": [1, 2]', '"args": 1, "kw": 2'),
     r"tasks\.jsonl:1: tests\[0\]: unknown key 'kw'"),
    ("  tasks: tasks.jsonl\n  verifier: {code: python}\n", CODE.replace('[{"args": [1, 2], "expected": 3}]', '[3]'),
     r"tasks\.jsonl:1: tests\[0\] must be an object"),
    ("  tasks: ../outside.jsonl\n  verifier: {code: python}\n", CODE,
     r"outside\.jsonl: a code practice set must lie in the scenarios folder"),
    ("  tasks: tasks.jsonl\n  verifier: {function: nope}\n", GOOD, r"'nope' is not pkg\.mod:fn"),
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n  samples: 0\n", GOOD, r"practice\.samples: .*minimum"),
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n  max_waiting: 0\n", GOOD,
     r"practice\.max_waiting: .*minimum"),
    ("  tasks: tasks.jsonl\n  verifier: {command: 'true', timeout: 3}\n", GOOD, r"practice\.verifier.*timeout"),
])
def test_mistakes_are_refused_at_load_naming_the_file_and_line(tmp_path: Path, practice: str, tasks: str,
                                                              message: str) -> None:
    with pytest.raises(config.ConfigError, match=message) as exc:
        config.compose(scenario(tmp_path, practice, tasks))
    assert "\n" not in str(exc.value) and str(exc.value).startswith(str(tmp_path))


def test_practice_records_are_never_a_canary_score() -> None:
    spec = trials.Spec(mode="canary", release="r2-bbbbbbb", stable="r1-aaaaaaa", started_at=0.0,
                       cfg=CanaryConfig(share=0.5))
    served = {"id": "01", "release": "r2-bbbbbbb", "turn_kind": "main"}
    assert trials.side_of(spec, served) is True
    assert trials.side_of(spec, {**served, "turn_kind": "practice"}) is None


def test_rounds_come_back_to_back_unless_rationed(tmp_path: Path) -> None:
    """A scenario that sets no `rounds_per_hour` practises a round as soon as the last one ended (with
    `max_waiting`, as soon as the trainer took its batch): a first run sees its releases within a minute, not one
    every 10 minutes."""
    cfg = config.compose(scenario(tmp_path, "  tasks: tasks.jsonl\n  verifier: {command: 'true'}\n"))
    assert cfg.practice.rounds_per_hour == 3600


def test_the_readmes_practice_scenario_trains_each_round_as_one_job(tmp_path: Path) -> None:
    """The README's scenario, copied as it stands: a round is one job's batch, asked at once, and the next round
    waits for that job (a max_waiting below the trigger's count would hold practice for good; above it, rounds
    would run ahead of the trainer). bench/practice_families.py measures what it learns."""
    block = re.search(r"```yaml\n(# scenarios/add\.yaml\n.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    scen = make_scenarios(tmp_path / "s", names=(), extra={"add": block.group(1)})
    (scen / "add-tasks.jsonl").write_text(GOOD)
    cfg = config.compose(scen / "add.yaml")
    practice, batch = cfg.practice, cfg.practice.tasks_per_round * cfg.practice.samples
    assert practice.max_waiting == batch == cfg.recipe.params["batch_size"] == cfg.trigger.every_n_records
    assert practice.concurrency == batch <= cfg.model.max_batch
    assert practice.rounds_per_hour == 3600 and practice.temperature < 1
