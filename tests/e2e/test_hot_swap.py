"""Releases served by the real daemon: publish, hot swap under load, rollback, promote, pins, restarts, bad input.

Adapters are real PEFT LoRA folders made for the daemon's own tiny model; each changes what the
model says, so a greedy answer tells which release produced it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora, make_other_base

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
PROMPT = [{"role": "user", "content": "Which release are you?"}]
TINY2 = "defaults:\n  - model: tiny\n  - release: follow\n  - _self_\nserve:\n  default_max_tokens: 8\n"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of this module's own: its chain is written to; every load proven (restarts and crashes too)."""
    base = tmp_path_factory.mktemp("hotswap")
    daemon = Daemon(scenarios=make_scenarios(base / "scenarios", extra={"tiny2": TINY2}), state=base / "state",
                    log_path=base / "reefd.log", proof=True)
    daemon.start()
    yield daemon
    if daemon.proc is not None and daemon.proc.poll() is None:
        daemon.stop()


@pytest.fixture(scope="module")
def loras(d: Daemon, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    model = d.state / "models" / "tiny"
    return {name: make_lora(model, root / name, seed=seed, scale=2.0) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


def client(d: Daemon, scenario: str = "tiny") -> openai.OpenAI:
    return sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                             default_headers={"x-reef-scenario": scenario}))


def ask(c: openai.OpenAI, stream: bool = False) -> tuple[str, str, str]:
    """(text, release header, receipt) of one greedy answer."""
    if stream:
        with c.chat.completions.with_streaming_response.create(
                model="tiny", messages=PROMPT, max_tokens=8, temperature=0, stream=True) as raw:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
            return text, raw.headers["x-reef-release-id"], raw.headers["x-reef-agent-record-id"]
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0)
    return (raw.parse().choices[0].message.content or "", raw.headers["x-reef-release-id"],
            raw.headers["x-reef-agent-record-id"])


def ctl(d: Daemon, *args: str) -> Any:
    out = reefctl(d, *args, "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status(d: Daemon, scenario: str = "tiny") -> dict[str, Any]:
    data = json.loads(d.get("/reef/status")[1])
    return next(s for s in data["scenarios"] if s["name"] == scenario)


def history(d: Daemon, scenario: str = "tiny", everything: bool = False) -> list[str]:
    page = json.loads(d.get(f"/reef/scenarios/{scenario}/releases" + ("?all=1" if everything else ""))[1])
    return [r["id"] for r in page["data"]]


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    return dict(json.loads(d.get(f"/reef/records/{receipt}")[1]))


def engine_adapters(d: Daemon) -> list[str]:
    return list(status(d)["engine"]["adapters"])


def test_publish_swap_rollback_promote(d: Daemon, loras: dict[str, Path]) -> None:
    c = client(d)
    base_text, base_release, _ = ask(c)
    assert base_release.startswith("r0-")

    published = ctl(d, "publish", "tiny", "--adapter", str(loras["a"]), "--summary", "first adapter")
    r1 = published["release"]["id"]
    assert published["serving"] == r1 and r1.startswith("r1-")
    assert published["release"]["meta"]["built_on"] == base_release
    a_text, served, receipt = ask(c)
    assert served == r1 and a_text != base_text  # the adapter is what answers now
    rec = record(d, receipt)
    assert rec["release"] == r1 and rec["adapter"] == r1
    assert ask(c, stream=True)[:2] == (a_text, r1)
    assert engine_adapters(d) == [r1]
    assert ask(client(d, "tiny2"))[0] == base_text  # the other scenario on the same engine is untouched

    rolled = ctl(d, "rollback", "tiny")
    r2 = rolled["release"]["id"]
    assert (rolled["from"], rolled["to"], rolled["serving"]) == (r1, base_release, r2)
    assert rolled["release"]["kind"] == "rollback" and r2.startswith("r2-")
    assert ask(c)[:2] == (base_text, r2)
    deadline = time.monotonic() + 10
    while engine_adapters(d) and time.monotonic() < deadline:  # unloaded once drained
        time.sleep(0.05)
    assert engine_adapters(d) == []

    promoted = ctl(d, "promote", "tiny", r1)
    r3 = promoted["release"]["id"]
    assert promoted["serving"] == r3 and promoted["release"]["meta"]["target"] == r1
    assert ask(c)[:2] == (a_text, r3)
    assert history(d) == [r3, r2, r1, base_release]

    diff = ctl(d, "diff", base_release, r1)
    assert diff["added"] == ["adapter/README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    assert "adapter/adapter_config.json" in diff["text"] and "adapter/adapter_model.safetensors" not in diff["text"]
    shown = ctl(d, "show", r3)
    lfs = [f for f in shown["files"] if f["lfs"]]
    assert [f["path"] for f in lfs] == ["adapter/adapter_model.safetensors"]
    assert lfs[0]["size"] == (loras["a"] / "adapter_model.safetensors").stat().st_size

    dry = ctl(d, "rollback", "tiny", "--to", base_release, "--dry-run")
    assert dry["dry_run"] is True and dry["to"] == base_release and history(d)[0] == r3


def test_swaps_under_load_fail_nothing_and_records_name_their_release(d: Daemon, loras: dict[str, Path]) -> None:
    c = client(d)
    expected: dict[str, str] = {}  # release -> the greedy answer it gives
    text, release, _ = ask(c)
    expected[release] = text
    stop = threading.Event()
    results: list[tuple[str, str, str]] = []
    errors: list[BaseException] = []

    def load(stream: bool) -> None:
        own = client(d)
        while not stop.is_set():
            try:
                results.append(ask(own, stream))
            except BaseException as exc:  # every failure counts
                errors.append(exc)

    threads = [threading.Thread(target=load, args=(i % 2 == 1,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        for step in ("b", "rollback", "c", "a"):
            time.sleep(0.5)
            if step == "rollback":
                out = ctl(d, "rollback", "tiny")
            else:
                out = ctl(d, "publish", "tiny", "--adapter", str(loras[step]))
            serving = out["serving"]
            time.sleep(0.5)
            expected[serving] = ask(c)[0]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == []
    served = {release for _, release, _ in results}
    assert len(served) >= 4 and served <= set(expected)
    wrong = [(release, text) for text, release, _ in results if expected[release] != text]
    assert wrong == []  # each answer is the one its release gives
    for text, release, receipt in results[:: max(1, len(results) // 40)]:
        rec = record(d, receipt)
        assert rec["release"] == release and rec["messages"][-1]["content"] == text
    assert len(engine_adapters(d)) <= 2


def test_restart_and_worker_crash_keep_the_head_serving(d: Daemon, loras: dict[str, Path]) -> None:
    c = client(d)
    head = ctl(d, "publish", "tiny", "--adapter", str(loras["b"]))["serving"]
    text = ask(c)[0]
    worker = status(d)["engine"]["pid"]
    os.kill(worker, signal.SIGKILL)  # the engine restarts without adapters; reefd loads them back first
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = status(d)
        if st["engine"]["state"] == "ready" and st["engine"]["pid"] != worker:
            break
        time.sleep(0.2)
    assert ask(c)[:2] == (text, head)

    assert d.proc is not None
    d.proc.kill()  # kill -9: no drain, no clean-up
    d.proc.wait()
    d.start()
    st = status(d)
    assert st["releases"]["head"] == st["releases"]["serving"] == st["release"] == head
    assert st["releases"]["drift"] == [] and st["engine"]["adapters"] == [head]
    answer, served, receipt = ask(c)
    assert (answer, served) == (text, head) and record(d, receipt)["release"] == head


def test_bad_input_changes_nothing(d: Daemon, loras: dict[str, Path], tmp_path: Path) -> None:
    before = {s: history(d, s, everything=True) for s in ("tiny", "tiny2")}
    serving = status(d)["release"]

    def refused(*args: str, message: str) -> None:
        out = reefctl(d, *args)
        assert out.returncode == 1 and message in out.stderr, out.stderr

    refused("rollback", "tiny", "--to", "r9-0000000", message="r9-0000000")
    refused("promote", "tiny", "r1-abcdef0", message="r1-abcdef0")
    refused("show", "r9-0000000", message="no release 'r9-0000000'")
    other = history(d, "tiny2")[0]
    refused("rollback", "tiny", "--to", other, message="is a release of scenario 'tiny2', not 'tiny'")
    refused("promote", "tiny2", history(d)[0], message="is a release of scenario 'tiny', not 'tiny2'")
    refused("rollback", "tiny", "--expected-head", other, message="nothing was written")

    foreign = make_lora(make_other_base(tmp_path / "other-base"), tmp_path / "foreign")
    refused("publish", "tiny", "--adapter", str(foreign), message="has shape")
    half = tmp_path / "half"
    shutil.copytree(loras["a"], half)
    weights = half / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut off midway
    refused("publish", "tiny", "--adapter", str(half), message="adapter_model.safetensors")
    no_config = tmp_path / "no-config"
    shutil.copytree(loras["a"], no_config)
    (no_config / "adapter_config.json").unlink()
    refused("publish", "tiny", "--adapter", str(no_config), message="adapter_config.json")

    for name in ("../x", "a/../../b", "a\0b", "..", "x.lock"):
        for verb in ("rollback", "promote"):
            code, body = post(d, f"/reef/scenarios/{urllib.parse.quote(name, safe='')}/{verb}",
                              {"release": "r0-0000000"})
            assert code in (400, 404), (name, code)
            assert json.loads(body)["error"]["code"] in ("invalid_scenario_name", "scenario_not_found")
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)"], cwd=d.state / "releases.git",
                          capture_output=True, text=True, check=True).stdout.split()
    assert all(r.startswith(("refs/reef/scenarios/tiny/", "refs/reef/scenarios/tiny2/")) for r in refs), refs
    assert {s: history(d, s, everything=True) for s in ("tiny", "tiny2")} == before
    assert status(d)["release"] == serving
    assert not list((d.state / "releases.git" / "lfs" / "tmp").iterdir())  # uploads cleaned up


def post(d: Daemon, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(d.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={**d.headers(), "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_pin_appends_a_rollback_and_refuses_writes(d: Daemon, loras: dict[str, Path]) -> None:
    c = client(d)
    first = history(d)[-1]
    head = history(d)[0]
    base_text = ask(client(d, "tiny2"))[0]
    tiny = d.scenarios / "tiny.yaml"
    original = tiny.read_text()
    try:
        tiny.write_text(original + f"release:\n  pin: {first}\n")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        # the status reads the binding and the drift one after the other: wait until both show the swap done
        st = wait_for(d, lambda s: s["releases"]["declared"] == first and s["release"] != head
                      and s["release"] == s["releases"]["head"] and not s["releases"]["drift"])
        pinned = st["release"]
        rel = json.loads(d.get(f"/reef/releases/{pinned}")[1])
        assert rel["kind"] == "rollback" and rel["meta"]["target"] == first and rel["meta"]["source"] == "pin"
        assert st["releases"]["head"] == pinned and st["releases"]["drift"] == []
        assert ask(c)[:2] == (base_text, pinned)
        out = reefctl(d, "publish", "tiny", "--adapter", str(loras["c"]))
        assert out.returncode == 1 and "pinned" in out.stderr
        assert reefctl(d, "rollback", "tiny").returncode == 1
        assert history(d)[0] == pinned

        tiny.write_text(original + "release:\n  pin: r7-0000000\n")  # a release that does not exist
        d.proc.send_signal(signal.SIGHUP)
        # until the reconcile after the reload has run, drift says only that the declared pin differs from the head
        st = wait_for(d, lambda s: s["releases"]["declared"] == "r7-0000000" and s["releases"]["drift"]
                      and "differs from the chain head" not in s["releases"]["drift"][0])
        assert "r7-0000000 is not a release of scenario 'tiny'" in st["releases"]["drift"][0]
        assert st["release"] == pinned and history(d)[0] == pinned  # still serving, nothing appended
        text = reefctl(d, "status").stdout
        assert "drift: release.pin: r7-0000000" in text
    finally:
        tiny.write_text(original)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        wait_for(d, lambda s: s["releases"]["declared"] is None and not s["releases"]["drift"])
    assert ctl(d, "publish", "tiny", "--adapter", str(loras["c"]))["serving"] == history(d)[0]


def wait_for(d: Daemon, condition: Any, scenario: str = "tiny", timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = status(d, scenario)
        if condition(st):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
