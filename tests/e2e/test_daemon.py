"""The daemon as operators see it: config checks, tokens, signals, engine restarts, crashes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, Daemon, make_scenarios, sdk


def reefd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reefd", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120)


def test_check_composes_every_shipped_scenario() -> None:
    out = reefd("--check", "--scenarios", str(ROOT / "scenarios"))
    assert out.returncode == 0, out.stderr
    assert "hello: ok (model smollm2, engine worker)" in out.stdout
    assert "tiny: ok (model tiny, engine worker)" in out.stdout


def test_bad_config_exits_2_with_one_line_naming_file_and_key(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path / "s", extra={
        "hello": "defaults:\n  - model: smollm2\n  - _self_\nmodel:\n  engine: wrker\n"})
    out = reefd("--check", "--scenarios", str(scen))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [f"{scen}/hello.yaml: model.engine: 'wrker' is not one of "
                     "['worker', 'sglang', 'vllm', 'upstream']"]


def test_schema_command_prints_json_schema() -> None:
    out = reefd("schema")
    schema = json.loads(out.stdout)
    shipped, dotted = schema["properties"]["model"]["properties"]["engine"]["anyOf"]
    assert shipped["enum"] == ["worker", "sglang", "vllm", "upstream"]
    assert dotted["pattern"] == r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # pkg.mod:Class, an engine of your own
    gate = schema["properties"]["gate"]
    assert {b["if"]["properties"]["kind"]["const"] for b in gate["allOf"]} == {"always", "holdout", "floor", "paired"}


def test_generated_token_is_private_and_never_logged(fresh_daemon: Daemon) -> None:
    fresh_daemon.env = {"REEF_TOKEN": ""}
    fresh_daemon.token = ""
    fresh_daemon.start(wait_ready=False)
    token_file = fresh_daemon.state / "token"
    deadline = time.monotonic() + 60
    while not token_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    fresh_daemon.token = token
    fresh_daemon.wait_ready()
    assert str(token_file) in fresh_daemon.logs()
    assert token not in fresh_daemon.logs()
    assert fresh_daemon.get("/reef/status")[0] == 200


def test_sigterm_drains_in_flight_streams_and_stops_workers(fresh_daemon: Daemon) -> None:
    fresh_daemon.start()
    status = json.loads(fresh_daemon.get("/reef/status")[1])
    worker_pid = status["scenarios"][0]["engine"]["pid"]
    c = sdk(openai.OpenAI(base_url=fresh_daemon.url + "/v1", api_key=fresh_daemon.token,
                      max_retries=0, default_headers={"x-reef-scenario": "tiny"}))
    lines: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with c.chat.completions.with_streaming_response.create(
                model="tiny", messages=[{"role": "user", "content": "long"}], stream=True,
                max_tokens=200, extra_body={"ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(60)
    assert fresh_daemon.stop(signal.SIGTERM) == 0
    t.join(60)
    assert lines[-1] == "data: [DONE]"
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)


def test_dead_worker_is_restarted_and_503_meanwhile(fresh_daemon: Daemon) -> None:
    fresh_daemon.start()
    pid = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["engine"]["pid"]
    os.kill(pid, signal.SIGKILL)
    c = sdk(openai.OpenAI(base_url=fresh_daemon.url + "/v1", api_key=fresh_daemon.token,
                      max_retries=0, default_headers={"x-reef-scenario": "tiny"}))
    with pytest.raises(openai.APIStatusError) as exc:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 503
    assert int(exc.value.response.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 120  # /readyz may still say 200 before the death is noticed
    engine: dict = {}
    while time.monotonic() < deadline:
        engine = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["engine"]
        if engine["state"] == "ready" and engine["pid"] != pid:
            break
        time.sleep(0.2)
    assert engine["restarts"] >= 1 and engine["pid"] != pid and engine["state"] == "ready"
    ok = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_acknowledged_receipts_survive_kill_9(fresh_daemon: Daemon) -> None:
    fresh_daemon.start()
    c = sdk(openai.OpenAI(base_url=fresh_daemon.url + "/v1", api_key=fresh_daemon.token,
                      max_retries=0, default_headers={"x-reef-scenario": "tiny"}))
    receipts: list[str] = []
    for i in range(12):
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"n={i}"}], max_tokens=2)
        receipt = raw.headers["x-reef-agent-record-id"]
        receipts.append(receipt)
        status, report, _ = fresh_daemon.post("/reef/report", {"score": i, "references": [receipt]})
        assert status == 200 and report["references"] == [receipt]
    # then traffic in flight, streamed and not, when the kill lands
    acked: list[str] = []
    stop = threading.Event()

    def traffic(k: int) -> None:
        with contextlib.suppress(Exception):  # the kill breaks these connections
            while not stop.is_set():
                if k % 2:
                    with c.chat.completions.with_streaming_response.create(
                            model="tiny", messages=[{"role": "user", "content": "s"}],
                            max_tokens=3, stream=True) as resp:
                        receipt = resp.headers["x-reef-agent-record-id"]
                        if "data: [DONE]" in list(resp.iter_lines()):  # acknowledged
                            acked.append(receipt)
                else:
                    raw = c.chat.completions.with_raw_response.create(
                        model="tiny", messages=[{"role": "user", "content": "n"}], max_tokens=3)
                    acked.append(raw.headers["x-reef-agent-record-id"])

    threads = [threading.Thread(target=traffic, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(acked) < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh_daemon.proc is not None
    engine = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["engine"]["pid"]
    fresh_daemon.proc.send_signal(signal.SIGKILL)
    fresh_daemon.proc.wait(30)
    stop.set()
    for t in threads:
        t.join(60)
    assert len(acked) >= 24
    deadline = time.monotonic() + 30  # its worker goes with it (forked from reefd's fork server, which goes too)
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine), f"the engine worker {engine} outlived reefd's SIGKILL"
    fresh_daemon.start()
    for i, receipt in enumerate(receipts):
        status, body = fresh_daemon.get(f"/reef/records/{receipt}")
        assert status == 200, receipt
        rec = json.loads(body)
        assert [r["score"] for r in rec["reports"]] == [i]
    for receipt in list(acked):
        assert fresh_daemon.get(f"/reef/records/{receipt}")[0] == 200, receipt
    counts = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]
    assert counts["records"] >= 12 + len(acked) and counts["reports"] == 12


def test_sighup_applies_new_scenarios_and_refuses_bad_ones(fresh_daemon: Daemon) -> None:
    fresh_daemon.start()
    assert fresh_daemon.proc is not None
    (fresh_daemon.scenarios / "second.yaml").write_text(
        "defaults:\n  - model: tiny\n  - _self_\ndescription: same model, second name\n")
    fresh_daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    names: list[str] = []
    while time.monotonic() < deadline and names != ["second", "tiny"]:
        names = [m["id"] for m in json.loads(fresh_daemon.get("/v1/models")[1])["data"]]
        time.sleep(0.2)
    assert names == ["second", "tiny"]
    engines = {s["engine"]["pid"] for s in
               json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"]}
    assert len(engines) == 1  # the same model is served by one worker
    status, _, headers = fresh_daemon.post("/v1/chat/completions", {
        "model": "second", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers={"x-reef-scenario": "second"})
    assert status == 200 and headers["x-reef-agent-record-id"]
    (fresh_daemon.scenarios / "broken.yaml").write_text("model:\n  engine: wrker\n")
    fresh_daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "reload refused" not in fresh_daemon.logs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "broken.yaml: model.engine: 'wrker' is not one of" in fresh_daemon.logs()
    assert fresh_daemon.get("/readyz")[0] == 200


def _stream_lines(d: Daemon, scenario: str, lines: list[str], started: threading.Event,
                  max_tokens: int = 600, headers: dict[str, str] | None = None) -> None:
    """The stream's SSE lines, after a first line with its receipt header (`receipt: R`)."""
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": scenario, **(headers or {})}))
    with c.chat.completions.with_streaming_response.create(
            model=scenario, messages=[{"role": "user", "content": "long"}], stream=True,
            max_tokens=max_tokens, extra_body={"ignore_eos": True}) as resp:
        lines.append(f"receipt: {resp.headers['x-reef-agent-record-id']}")
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                started.set()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_engine_death_mid_stream_ends_it_in_band(fresh_daemon: Daemon) -> None:
    fresh_daemon.start()
    pid = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["engine"]["pid"]
    lines: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream_lines, args=(fresh_daemon, "tiny", lines, started, 4000))
    t.start()
    assert started.wait(60)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert "data: [DONE]" not in lines
    error = json.loads(lines[-1][len("data: "):])["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    receipt = lines[0].split(": ", 1)[1]  # the client holds this receipt: its record says what happened
    record = json.loads(fresh_daemon.get(f"/reef/records/{receipt}")[1])
    assert record["finish_reason"] == "error" and record["error"]["code"] == "engine_error"
    delivered = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in lines[1:-1] if line.startswith("data: {") and '"choices"' in line
                        and json.loads(line[6:])["choices"])
    assert record["messages"][-1] == {"role": "assistant", "content": delivered}
    fresh_daemon.wait_ready()  # restarted, and the daemon itself never stopped serving


def test_reload_drains_requests_on_an_engine_it_removes(fresh_daemon: Daemon) -> None:
    other = fresh_daemon.scenarios / "other.yaml"
    other.write_text("defaults:\n  - model: tiny\n  - _self_\nmodel:\n  max_batch: 4\n")
    fresh_daemon.start()
    engines = {s["name"]: s["engine"]["pid"]
               for s in json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"]}
    assert engines["other"] != engines["tiny"]  # a different model config: its own worker
    lines: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream_lines, args=(fresh_daemon, "other", lines, started, 400))
    t.start()
    assert started.wait(60)
    other.unlink()
    assert fresh_daemon.proc is not None
    fresh_daemon.proc.send_signal(signal.SIGHUP)
    t.join(120)
    assert lines[-1] == "data: [DONE]"  # the removed scenario's last answer completed
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(engines["other"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the unused worker was not stopped after it drained")
    names = [m["id"] for m in json.loads(fresh_daemon.get("/v1/models")[1])["data"]]
    assert names == ["tiny"]


def test_first_start_records_the_base_release_and_restarts_keep_it(fresh_daemon: Daemon) -> None:
    from reefd.commit.chain import ReleaseChain
    from reefd.commit.identity import sha256_file

    fresh_daemon.seed_tiny = False  # this daemon prepares its tiny model itself, as a fresh install does
    fresh_daemon.start()
    release = json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["release"]
    head = ReleaseChain(fresh_daemon.state / "releases.git").head("tiny")
    assert head is not None and head.id == release and head.kind == "base" and head.seq == 0
    ident = head.meta["identity"]
    model = fresh_daemon.state / "models" / "tiny"
    assert ident["weights"] == {"model.safetensors": sha256_file(model / "model.safetensors")}
    assert ident["tokenizer"] == sha256_file(model / "tokenizer.json")
    status, _, headers = fresh_daemon.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert status == 200 and headers["x-reef-release-id"] == release
    receipt = headers["x-reef-agent-record-id"]
    assert fresh_daemon.stop() == 0
    fresh_daemon.start()
    assert json.loads(fresh_daemon.get("/reef/status")[1])["scenarios"][0]["release"] == release
    assert json.loads(fresh_daemon.get(f"/reef/records/{receipt}")[1])["release"] == release
    assert len(ReleaseChain(fresh_daemon.state / "releases.git").history("tiny")) == 1
