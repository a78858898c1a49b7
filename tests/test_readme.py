"""The README's quick start executes: its commands, run as written against a real reefd.

Only the address and the model differ: the daemon listens on a free port, and its "hello"
scenario runs the tiny model so the suite stays fast (hello.yaml itself is composed in
tests/test_config.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, Daemon, make_scenarios


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, re.DOTALL)
    block = next(b for b in blocks if "curl -s localhost:8900/v1/chat/completions" in b)
    return [cmd.strip() for cmd in block.replace("\\\n", " ").splitlines() if cmd.strip()]


def test_quick_start_commands_work_as_written(tmp_path: Path) -> None:
    hello = "defaults:\n  - model: tiny\n  - _self_\nserve:\n  default_max_tokens: 8\n"
    d = Daemon(scenarios=make_scenarios(tmp_path / "s", names=(), extra={"hello": hello}),
               state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    env = {**os.environ, "REEF_TOKEN": d.token, "REEF_URL": d.url,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    commands = quick_start_commands()
    assert [c.split()[0] for c in commands] == ["curl", "curl", "reefctl", "reefctl"]
    outputs = []
    receipt = ""
    try:
        for cmd in commands:
            cmd = cmd.replace("localhost:8900", f"127.0.0.1:{d.port}").replace("<receipt>", receipt)
            out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env,
                                 timeout=60)
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
