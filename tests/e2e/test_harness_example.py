"""The harness scenario `make run` serves beside `hello` (scenarios/coder.yaml): it installs into an agent with
the one-line installer, its rules reach the system prompt, and its config.yaml sets the sampling defaults."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, Daemon, make_scenarios

SHIPPED = ROOT / "scenarios" / "coder-harness"


def test_the_shipped_harness_example_installs_and_takes_effect(tmp_path: Path) -> None:
    coder = (ROOT / "scenarios" / "coder.yaml").read_text().replace("- model: smollm2", "- model: tiny")
    hello = "defaults:\n  - model: tiny\n  - _self_\n"
    scenarios = make_scenarios(tmp_path / "s", names=(), extra={"hello": hello, "coder": coder})
    shutil.copy(ROOT / "scenarios" / "coder-tasks.jsonl", scenarios)
    d = Daemon(scenarios=scenarios, state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    try:
        status, answer, headers = d.post("/v1/chat/completions", {"model": "x", "max_tokens": 4,
                                                                   "messages": [{"role": "user", "content": "hi"}]},
                                         headers={"x-reef-scenario": "coder"})
        assert status == 200, answer
        record = json.loads(d.get(f"/reef/records/{headers['x-reef-agent-record-id']}")[1])
        rule = (SHIPPED / "rules" / "style.md").read_text().split("\n")[0]
        assert record["harness"] == record["release"] and rule in record["messages"][0]["content"]
        assert record["sampling"]["temperature"] == 0.2 and record["sampling"]["top_p"] == 0.9  # config.yaml
        status, answer, headers = d.post("/v1/chat/completions", {"model": "x", "max_tokens": 4, "temperature": 1.0,
                                                                   "messages": [{"role": "user", "content": "hi"}]},
                                         headers={"x-reef-scenario": "coder"})
        record = json.loads(d.get(f"/reef/records/{headers['x-reef-agent-record-id']}")[1])
        assert record["sampling"]["temperature"] == 1.0  # the request's own setting wins
        request = urllib.request.Request(d.url + "/reef/harness/install?adapter=claude&scenario=coder",
                                         headers={"Authorization": f"Bearer {d.token}"})
        with urllib.request.urlopen(request, timeout=60) as r:
            script = r.read()
        home = tmp_path / "home"
        home.mkdir()
        env = {"HOME": str(home), "PATH": os.environ["PATH"], "REEF_TOKEN": d.token}
        out = subprocess.run(["sh"], input=script, env=env, capture_output=True, timeout=60,
                             start_new_session=True)  # no terminal: no extension may be enabled
        assert out.returncode == 0, out.stderr.decode()
        assert rule in (home / ".claude" / "CLAUDE.md").read_text()
        skill = home / ".claude" / "skills" / "commit-messages" / "SKILL.md"
        assert skill.read_text() == (SHIPPED / "skills" / "commit-messages" / "SKILL.md").read_text()
        assert (home / ".local" / "bin" / "reef-coder").is_file()
        assert "Review the diff for bugs first" in (home / ".claude" / "commands" / "review.md").read_text()
        assert "name: reviewer\n" in (home / ".claude" / "agents" / "reviewer.md").read_text()
        assert "not enabled, waiting for your yes: git lint" in out.stderr.decode()
        assert not (home / ".local/share/reef/coder/claude/settings.json").exists()
    finally:
        d.stop()


def test_a_harness_config_key_that_would_do_nothing_is_refused(tmp_path: Path) -> None:
    from reefd import config

    scenarios = make_scenarios(tmp_path / "s", names=())
    shutil.copy(ROOT / "scenarios" / "coder-tasks.jsonl", scenarios)
    (scenarios / "coder.yaml").write_text((ROOT / "scenarios" / "coder.yaml").read_text())
    (scenarios / "coder-harness" / "config.yaml").write_text("temperature: 0.2\npermissions: [ls]\n")
    unread = "harness.dir: config.yaml: 'permissions' is not a setting reefd reads"
    with pytest.raises(config.ConfigError, match=re.escape(unread)):
        config.load_all(scenarios)
    (scenarios / "coder-harness" / "config.yaml").write_text("temperature: 7\n")
    with pytest.raises(config.ConfigError, match=re.escape("config.yaml: temperature: 7 is not a number from 0 to 2")):
        config.load_all(scenarios)
