"""`reefctl` against the real daemon: status, records, report, and its connection fallbacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import openai

from tests.conftest import ROOT, Daemon, sdk


def reefctl(d: Daemon, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    return subprocess.run([sys.executable, "-m", "reefd.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60,
                          env={**base, "REEF_URL": d.url, "REEF_TOKEN": d.token, **(env or {})})


def ask(d: Daemon) -> str:
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                      default_headers={"x-reef-scenario": "tiny"}))
    raw = c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "for reefctl"}], max_tokens=3)
    return raw.headers["x-reef-agent-record-id"]


def test_status_table_and_json(daemon: Daemon) -> None:
    out = reefctl(daemon, "status")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split()[:5] == ["SCENARIO", "MODEL", "ENGINE", "STATE", "QUEUE"]
    assert row.split()[:5] == ["tiny", "tiny", "worker", "ready", "0/8+0"]  # none generating of 8 turns
    assert re.fullmatch(r"r0-[0-9a-f]{7}", row.split()[5])  # the base release
    data = json.loads(reefctl(daemon, "status", "-o", "json").stdout)
    assert data["scenarios"][0]["engine"]["state"] == "ready"


def test_report_then_records_show_the_score(daemon: Daemon) -> None:
    receipt = ask(daemon)
    out = reefctl(daemon, "report", receipt, "--score", "0.75", "--feedback", "fine")
    assert out.returncode == 0, out.stderr
    lines = reefctl(daemon, "records", "tiny", "-o", "json").stdout.splitlines()
    records = {r["id"]: r for r in map(json.loads, lines)}
    assert records[receipt]["reports"][0]["score"] == 0.75
    table = reefctl(daemon, "records", "tiny").stdout
    assert any(line.startswith(receipt) and "0.75" in line for line in table.splitlines())
    assert reefctl(daemon, "records", "tiny", "-o", "name").stdout.count("record/") == len(records)


def test_bad_score_and_unknown_receipt_fail_cleanly(daemon: Daemon) -> None:
    nan = reefctl(daemon, "report", "x", "--score", "nan")
    assert nan.returncode == 2 and "score" in nan.stderr
    ghost = reefctl(daemon, "report", "01ARZ3NDEKTSV4RRFFQ69G5FAV", "--score", "1",
                    "--scenario", "tiny")
    assert ghost.returncode == 1 and "unknown receipt" in ghost.stderr and ghost.stdout == ""


def test_wrong_token_and_down_daemon_exit_non_zero(daemon: Daemon) -> None:
    bad = reefctl(daemon, "status", "--token", "nope")
    assert bad.returncode == 1 and "invalid API token" in bad.stderr
    down = reefctl(daemon, "status", env={"REEF_URL": "http://127.0.0.1:9"})
    assert down.returncode != 0 and "cannot reach reefd" in down.stderr


def test_token_file_in_the_state_dir_is_found(daemon: Daemon) -> None:
    home = daemon.state.parent / "home"
    state = home / ".local" / "state" / "reefd"
    state.mkdir(parents=True)
    (state / "token").write_text(daemon.token + "\n")
    out = reefctl(daemon, "status", "-o", "json", env={"REEF_TOKEN": "", "HOME": str(home)})
    assert out.returncode == 0, out.stderr


def test_records_of_one_session_in_order(daemon: Daemon) -> None:
    c = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
                          default_headers={"x-reef-scenario": "tiny"}))
    turns = []
    for i in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"turn {i}"}], max_tokens=1,
            extra_headers={"x-reef-session": "conv-7"})
        turns.append(raw.headers["x-reef-agent-record-id"])
    ask(daemon)  # another conversation's turn in between
    out = reefctl(daemon, "records", "tiny", "--session", "conv-7", "-o", "name")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"record/{r}" for r in turns]


def test_history_and_show_read_the_release_chain(daemon: Daemon, tmp_path: Path) -> None:
    from reefd.commit.chain import ReleaseChain

    log = reefctl(daemon, "history", "tiny")
    assert log.returncode == 0, log.stderr
    first = log.stdout.splitlines()[0]
    assert re.fullmatch(r"release r0-[0-9a-f]{7} \(HEAD -> serving\)", first)
    assert "Kind:    base" in log.stdout and "Source:  import" in log.stdout
    base = first.split()[1]
    shown = json.loads(reefctl(daemon, "show", f"release/{base}", "-o", "json").stdout)
    assert shown["kind"] == "base" and shown["meta"]["identity"]["model"] == "tiny"
    assert {f["path"] for f in shown["files"]} == {"release.json", ".gitattributes"}
    # an adapter release with a real LFS file, published to the daemon's chain directly
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (adapter / "adapter_config.json").write_text("{}")
    chain = ReleaseChain(daemon.state / "releases.git")
    r0 = chain.publish("lab", expected_head=None, kind="base", artifact_dir=None, meta={})
    r1 = chain.publish("lab", expected_head=r0.id, kind="adapter", artifact_dir=adapter,
                       meta={"source": "test"})
    table = reefctl(daemon, "show", r1.id)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines()
               if line.startswith("adapter/adapter_model.safetensors"))
    assert row.split()[1:] == ["4096", row.split()[2], "yes"]
    missing = reefctl(daemon, "show", "r9-0000000")
    assert missing.returncode == 1 and "no release" in missing.stderr
    assert reefctl(daemon, "history", "ghost").returncode == 1
