"""Practice through the real daemon on the tiny model: reefd answers its practice set with the serving release,
a sandboxed verifier checks each answer, and both are kept as practice records with `source: verifier` reports,
apart from served traffic; SAO trains on them with no client report at all; the composite recipe makes one
candidate of an adapter and a skill from the same verdicts, released, served and rolled back together; a verifier
that hangs or crashes is a failed verification shown in status, and serving goes on."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, sdk, shared_daemon
from tests.e2e.test_grow import status, wait_job
from tests.e2e.test_harness import harness_dir
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_reefctl import reefctl
from tests.fake_upstream import build
from tests.served import aiohttp_in_thread

TASKS = "".join(json.dumps({"prompt": f"Say a word with {n} letters.", "letters": n}) + "\n" for n in range(2, 6))
EVEN = "test $(( $(wc -c < answer.txt) % 2 )) -eq 0"  # right when the answer has an even number of bytes


def practice_yaml(verifier: str, recipe: str = "record", extra: str = "", samples: int = 2,
                  max_waiting: str = "null") -> str:
    return (f"defaults:\n  - model: tiny\n  - recipe: {recipe}\n  - release: follow\n  - _self_\n"
            f"serve:\n  default_max_tokens: 8\n{extra}"
            f"practice:\n  tasks: practice-tasks.jsonl\n  verifier:\n{verifier}"
            f"  tasks_per_round: 4\n  samples: {samples}\n  rounds_per_hour: 3600\n  max_tokens: 6\n"
            f"  max_waiting: {max_waiting}\n")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("practice"), env={"UP_KEY": "up-key"}, proof=True)


@pytest.fixture
def practising(d: Daemon, own_scenario: Callable[..., str]) -> Callable[..., str]:
    def add(verifier: str = f"    command: '{EVEN}'\n", **kw: Any) -> str:
        return own_scenario(d, practice_yaml(verifier, **kw), prefix="practice",
                            files={"practice-tasks.jsonl": TASKS})

    return add


def practice_status(d: Daemon, name: str, key: str, at_least: int, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = status(d, name).get("practice") or {}
        if found.get(key, 0) >= at_least:
            return dict(found)
        time.sleep(0.2)
    raise AssertionError(f"practice {key} never reached {at_least}: {status(d, name)}\n{d.logs()}")


def records(d: Daemon, name: str, practice: str = "include") -> list[dict[str, Any]]:
    code, body = d.get(f"/reef/scenarios/{name}/records?limit=1000&practice={practice}")
    assert code == 200, body
    return list(json.loads(body)["data"])


def test_practice_answers_are_verified_into_records_apart_from_traffic(d: Daemon,
                                                                        practising: Callable[..., str]) -> None:
    name = practising()
    found = practice_status(d, name, "verified", 8)
    assert found["tasks"] == "practice-tasks.jsonl" and found["verifier"] == EVEN
    assert found["passed"] + found["failed"] == found["verified"] and found["verifier_errors"] == 0

    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    served = c.chat.completions.with_raw_response.create(model=name, max_tokens=8,
                                                         messages=[{"role": "user", "content": "hello"}])
    assert served.status_code == 200  # serving goes on beside practice

    recs = records(d, name)
    practice = [r for r in recs if r.get("turn_kind") == "practice"]
    traffic = [r for r in recs if r.get("turn_kind") != "practice"]
    assert [r["id"] for r in traffic] == [served.headers["x-reef-agent-record-id"]]
    assert not traffic[0].get("reports") and "practice" not in traffic[0]
    assert len(practice) >= 8
    for rec in practice:
        assert rec["practice"]["tasks"] == "practice-tasks.jsonl" and rec["practice"]["task"].endswith(
            tuple(f"practice-tasks.jsonl:{n}" for n in range(1, 5)))
        assert rec["session"] is None and rec["release"] == traffic[0]["release"]  # the serving release
        assert rec["prompt_token_ids"] and len(rec["completion_token_ids"]) == len(rec["completion_logprobs"])
        verdicts = [r for r in rec.get("reports") or [] if r["source"] == "verifier"]
        if not verdicts:  # the newest answers' verdicts may still be on their way
            continue
        (report,) = verdicts
        right = len(rec["response"]["text"].encode()) % 2 == 0
        assert report["score"] == (1.0 if right else 0.0), (rec["response"], report)
        assert report["metadata"]["returncode"] == (0 if right else 1) and report["metadata"]["error"] is None
        assert report["metadata"]["verifier"] == EVEN and report["metadata"]["task"] == rec["practice"]["task"]
    per_task = Counter((r["practice"]["round"], r["practice"]["task"]) for r in practice)
    assert max(per_task.values()) == 2  # two samples of a task in a round: a group of the same prompt

    shown = status(d, name)  # status and metrics count served traffic and practice apart
    assert shown["records"] == 1 and shown["reports"] == 0
    assert shown["practice"]["records"] >= len(practice) and shown["practice"]["reports"] >= 8
    families = scrape(d.url + "/metrics", d.token)
    assert value(families, "reef_records_total", scenario=name) == 1
    assert value(families, "reef_reports_total", scenario=name) == 0
    assert value(families, "reef_practice_records_total", scenario=name) >= len(practice)
    assert value(families, "reef_practice_answers_total", scenario=name) >= 8
    verdicts = {v: value(families, "reef_practice_verdicts_total", scenario=name, verdict=v)
                for v in ("passed", "failed", "error")}
    assert verdicts["passed"] + verdicts["failed"] >= 8 and verdicts["error"] == 0


CODE_TASKS = "".join(json.dumps({"prompt": f"Write a Python function `plus{n}(a)` that returns a + {n}.",
                                 "entry": f"plus{n}", "tests": [{"args": [1], "expected": 1 + n}]}) + "\n"
                     for n in range(2))


def test_a_code_practice_set_is_scored_by_running_the_answers(d: Daemon, own_scenario: Callable[..., str]) -> None:
    """`verifier.code: python` through the daemon: each answer of the tiny model's (no passing code, nor likely any
    code at all) is run against its task's tests in the code sandbox and scored 0, with feedback saying why, and
    never a verifier error."""
    yaml = practice_yaml("    code: python\n", samples=1).replace("practice-tasks.jsonl", "code-practice.jsonl")
    name = own_scenario(d, yaml, prefix="practice", files={"code-practice.jsonl": CODE_TASKS})
    found = practice_status(d, name, "verified", 2)
    assert found["verifier"] == "code: python" and found["verifier_errors"] == 0 and found["passed"] == 0, found
    reports = [r for rec in records(d, name, "only") for r in rec.get("reports") or []]
    assert reports and all(r["score"] == 0.0 and r["metadata"]["error"] is None for r in reports), reports
    assert all(r["metadata"]["tests"] == 1 and r["feedback"].startswith(
        ("the code did not load: ", "passed 0 of 1 tests", "the code stopped after")) for r in reports), reports


def test_listings_and_exports_keep_practice_apart(d: Daemon, practising: Callable[..., str]) -> None:
    name = practising()
    practice_status(d, name, "answers", 4)
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    served = c.chat.completions.with_raw_response.create(model=name, max_tokens=4,
                                                         messages=[{"role": "user", "content": "hello"}])
    receipt = served.headers["x-reef-agent-record-id"]
    assert [r["id"] for r in records(d, name, "exclude")] == [receipt]
    only = records(d, name, "only")
    assert only and {r["turn_kind"] for r in only} == {"practice"}
    assert len(records(d, name)) >= len(only) + 1
    code, body = d.get(f"/reef/scenarios/{name}/export?practice=only")
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    assert code == 200 and lines and {r["turn_kind"] for r in lines} == {"practice"}
    code, body = d.get(f"/reef/scenarios/{name}/records?practice=some")
    assert code == 400 and json.loads(body)["error"]["param"] == "practice", body
    shown = reefctl(d, "records", name, "--practice", "exclude", "-o", "name")
    assert shown.returncode == 0 and shown.stdout.split() == [f"record/{receipt}"], shown.stderr


def test_max_waiting_holds_rounds_while_a_batch_waits_for_its_job(d: Daemon, practising: Callable[..., str]) -> None:
    """Nothing consumes this scenario's records (it only records): once 4 scored records wait, no round starts."""
    name = practising(samples=1, extra="", max_waiting="4")
    found = practice_status(d, name, "rounds", 1)  # a round counts once all its answers are verified
    assert found["verified"] == found["answers"] == 4, found
    time.sleep(3)  # 3 more rounds' worth (a round a second), none started
    later = status(d, name)["practice"]
    assert later["rounds"] == 1 and later["answers"] == 4, later


def test_a_verifier_cannot_leak_reefds_environment_into_its_reports(d: Daemon,
                                                                      practising: Callable[..., str]) -> None:
    """The probe's P1: a verifier that prints every environment it can read inside (PID 1 is bubblewrap's init)
    puts none of reefd's (its root token, the upstream key) into the reports a read-scoped token can fetch."""
    dump = "env; tr \"\\\\0\" \"\\\\n\" </proc/1/environ; exit 1"
    name = practising(f"    command: '{dump}'\n", samples=1)
    practice_status(d, name, "verified", 2)
    code, body = d.get(f"/reef/scenarios/{name}/records?limit=1000&practice=only")
    assert code == 200
    reports = [r for rec in json.loads(body)["data"] for r in rec.get("reports") or []]
    assert reports and d.token.encode() not in body and b"up-key" not in body and b"REEF_TOKEN" not in body
    assert all("PATH=" in r["feedback"] for r in reports), reports  # it did print what it read


@pytest.mark.parametrize("verifier", ["    command: 'sleep 30'\n    timeout_s: 0.5\n",
                                      "    command: 'kill -9 $$'\n"])
def test_a_broken_verifier_fails_its_verifications_and_serving_goes_on(d: Daemon, practising: Callable[..., str],
                                                                       verifier: str) -> None:
    name = practising(verifier, samples=1)
    found = practice_status(d, name, "verifier_errors", 2)
    assert found["passed"] == 0 and "verifier failed on" in found["last_error"]["message"]
    assert ("timed out" if "sleep" in verifier else "killed by signal 9") in found["last_error"]["message"]
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    assert c.chat.completions.create(model=name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]).choices
    reports = [r for rec in records(d, name) for r in rec.get("reports") or []]
    assert reports and all(r["score"] == 0.0 and r["metadata"]["error"] for r in reports)
    shown = reefctl(d, "status").stdout
    assert f"scenario {name}: practice (practice-tasks.jsonl, verifier " in shown
    assert f"scenario {name}: practice: last error: verifier failed on" in shown


def test_sao_trains_on_practice_alone(d: Daemon, practising: Callable[..., str]) -> None:
    """No client sends anything: practice's verified answers fill SAO's batch, and its job publishes. With
    max_waiting, the next round waits for that job, so it is answered by the release the job made."""
    name = practising(recipe="sao", samples=1, max_waiting="4",
                      extra="trigger:\n  every_n_records: 4\nrecipe:\n  params:\n    batch_size: 4\n")
    job = wait_job(d, ("published",), name=name)
    practice_status(d, name, "rounds", 2)
    second = [r for r in records(d, name, "only") if r["practice"]["round"] == 2]
    assert len(second) == 4 and {r["release"] for r in second} == {job["release"]}, second
    code, body = d.get(f"/reef/releases/{job['release']}/lineage")
    assert code == 200, body
    trained = json.loads(body)["releases"][0]["learned_from"]
    assert len(trained) == 4
    for entry in trained:
        rec = json.loads(d.get(entry["record"])[1])
        assert rec["turn_kind"] == "practice" and [r["source"] for r in rec["reports"]] == ["verifier"]


SKILL_NOTE = {"summary": "odd-length answers fail", "decisions": [
    {"kind": "skill", "name": "even-answers", "action": "create", "description": "Give answers of an even length.",
     "body": "Count the characters of your answer; add one if the count is odd.", "reason": "failed verdicts"}]}
COMPOSITE = """recipe:
  name: composite
  params:
    weights: sao
    weights_params: {{batch_size: 4}}
    harness: skillclaw
    harness_params:
      batch_size: 4
      proposer: {{engine: upstream, url: "{url}", api_key_env: UP_KEY, upstream_model: proposer}}
gate:
  kind: paired
  tasks: gate-tasks.jsonl
  min_tasks: 2
  max_tokens: 4
  scorer: tests.e2e.test_harness:length_parity
  min_win_margin: -100
harness:
  dir: {harness}
"""


def served(d: Daemon, name: str) -> dict[str, Any]:
    """The record of one served turn, now."""
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    raw = c.chat.completions.with_raw_response.create(model=name, max_tokens=4,
                                                      messages=[{"role": "user", "content": "hi"}])
    return dict(json.loads(d.get(f"/reef/records/{raw.headers['x-reef-agent-record-id']}")[1]))


def test_composite_releases_an_adapter_and_a_skill_together(d: Daemon, own_scenario: Callable[..., str],
                                                            tmp_path: Any) -> None:
    """Practice verdicts feed both halves: SAO trains the adapter on the batch, SkillClaw (a scripted proposer,
    as hosted models are unreachable here) writes a skill from its failed answers; one gate, one `bundle` release
    holding adapter/ and harness/, served at once, explained, delivered, and rolled back in one step. Every answer
    fails its verification here: the batch is the oldest four, and with the even-length verifier those could all
    pass, leaving SkillClaw no failed answer to write from."""
    answer = tmp_path / "answer.txt"
    answer.write_text(json.dumps(SKILL_NOTE))
    with aiohttp_in_thread(build(str(answer))) as url:
        harness_dir(d.scenarios / "bundle-harness")
        name = own_scenario(d, practice_yaml("    command: 'exit 1'\n", samples=1, extra=COMPOSITE.format(
            url=f"{url}/v1", harness="bundle-harness")), prefix="bundle", files={
            "practice-tasks.jsonl": TASKS, "gate-tasks.jsonl": "".join(
                json.dumps({"prompt": f"task {i}", "answer": ""}) + "\n" for i in range(2))})
        found = practice_status(d, name, "failed", 1)
        practice_status(d, name, "verified", 4)
        assert found["tasks"] == "practice-tasks.jsonl"
        before = served(d, name)
        started = reefctl(d, "train", name)
        assert started.returncode == 0, started.stderr
        job = wait_job(d, ("published", "rejected", "failed", "skipped"), name=name)
    assert job["state"] == "published", job
    code, body = d.get(f"/reef/releases/{job['release']}")
    rel = json.loads(body)
    assert code == 200 and rel["kind"] == "bundle", rel
    paths = {f["path"] for f in rel["files"]}
    assert "adapter/adapter_model.safetensors" in paths and "harness/skills/even-answers/SKILL.md" in paths
    assert rel["meta"]["gate"]["verdict"] == "pass" and rel["meta"]["gate"]["tasks"] == 2  # gated once
    assert [m["id"] for m in rel["meta"]["mutations"]] == ["even-answers"] and rel["meta"]["metrics"]["steps"]

    after = served(d, name)  # one release serves both: its adapter, and its skill in the system prompt
    assert after["release"] == job["release"] and after["adapter"] == job["release"]
    assert "Give answers of an even length." in after["messages"][0]["content"]
    assert before["adapter"] is None and "even length" not in before["messages"][0]["content"]

    shown = reefctl(d, "explain", job["release"])
    assert shown.returncode == 0, shown.stderr
    assert f"release/{job['release']}  bundle  released" in shown.stdout
    assert "Mutation: create skill even-answers" in shown.stdout and "Learned from 4 records" in shown.stdout
    code, body = d.get(f"/reef/harness/releases?scenario={name}")
    assert code == 200 and json.loads(body)["current"] == job["release"], body
    code, script = d.get(f"/reef/harness/install?adapter=claude&scenario={name}")
    assert code == 200 and job["release"].encode() in script and b"even-answers" in script

    back = reefctl(d, "rollback", name)
    assert back.returncode == 0, back.stderr
    undone = served(d, name)  # both halves go back at once
    assert undone["release"] != job["release"] and undone["adapter"] is None
    assert "even length" not in undone["messages"][0]["content"]
