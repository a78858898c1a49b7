"""Grow through the real daemon on the tiny model: requests → reports → trigger → trainer subprocess → gate →
publish → hot swap, and the ways a job can fail, be refused or be interrupted.

One reefd serves the module (`grow`), each test on a scenario of its own (`learn`); the tests that restart or
kill reefd start their own. A test that wants its trainer to fail says so in its scenario (`recipe.fault`)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, make_scenarios, sdk, shared_daemon
from tests.e2e.test_reefctl import reefctl

LEARN = """defaults:
  - model: tiny
  - recipe: sao
  - trigger: {trigger}
  - gate: {gate}
  - release: follow
  - _self_
recipe:
{recipe}  params:
    batch_size: 4
{params}serve:
  default_max_tokens: 8
{extra}"""


def learn_yaml(trigger: str = "count", gate: str = "always", extra: str = "", recipe: str = "",
               params: str = "", fault: str | None = None, hold: Path | None = None) -> str:
    """A learning scenario. `recipe`: lines under `recipe:` (indented 2), `params`: lines under its params
    (indented 4); `fault` (with `hold`, its file): the trainer fails on purpose (reefd/train/spec.py FAULTS).
    A count trigger fires at 4 scored records."""
    if fault is not None:
        recipe += f"  fault:\n    kind: {fault}\n" + (f"    hold: {hold}\n" if hold is not None else "")
    if trigger == "count":
        extra += "trigger:\n  every_n_records: 4\n"
    return LEARN.format(trigger=trigger, gate=gate, extra=extra, recipe=recipe, params=params)


def daemon(tmp_path: Path, trigger: str = "count", gate: str = "always", extra: str = "",
           env: dict[str, str] | None = None, files: dict[str, str] | None = None, recipe: str = "",
           params: str = "", fault: str | None = None, hold: Path | None = None, proof: bool = False) -> Daemon:
    """A reefd of the caller's own serving one learning scenario, `learn` (see `learn_yaml`); `proof`: its
    releases proven (tests/conftest.py `unproven`)."""
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={
        "learn": learn_yaml(trigger, gate, extra, recipe, params, fault, hold)})
    for name, text in (files or {}).items():
        (scen / name).write_text(text)
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log", env=env or {}, proof=proof)
    d.start()
    return d


@pytest.fixture(scope="module")
def grow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The module's reefd: `tiny` (which does not train), and each test's learning scenario."""
    yield from shared_daemon(tmp_path_factory.mktemp("grow"))


@pytest.fixture
def learn(grow: Daemon, own_scenario: Callable[..., str]) -> Callable[..., str]:
    """`learn(**learn_yaml's arguments, files=...)`: a learning scenario of the test's own on `grow`; its name."""

    def add(files: dict[str, str] | None = None, proof: bool = False, **kw: Any) -> str:
        return own_scenario(grow, learn_yaml(**kw), prefix="learn", files=files, proof=proof)

    return add


def client(d: Daemon, name: str = "learn") -> openai.OpenAI:
    return sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                             default_headers={"x-reef-scenario": name}))


def turn(d: Daemon, c: openai.OpenAI, content: str, score: float | None = None, name: str = "learn"
         ) -> tuple[str, str, str]:
    """(receipt, release, text) of one answer; reported with `score` when given."""
    raw = c.chat.completions.with_raw_response.create(
        model=name, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=1.0)
    receipt, release = raw.headers["x-reef-agent-record-id"], raw.headers["x-reef-release-id"]
    if score is not None:
        code, body, _ = d.post("/reef/report", {"score": score, "references": [receipt]},
                               headers={"x-reef-scenario": name})
        assert code == 200, body
    return receipt, release, raw.parse().choices[0].message.content or ""


def jobs(d: Daemon, name: str = "learn") -> list[dict[str, Any]]:
    return list(json.loads(d.get(f"/reef/jobs?scenario={name}")[1])["data"])


def wait_job(d: Daemon, states: tuple[str, ...] = ("published", "rejected", "failed", "skipped"),
             timeout_s: float = 180, seen: tuple[str, ...] = (), name: str = "learn") -> dict[str, Any]:
    """The newest job not in `seen`, once it is in one of `states`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [j for j in jobs(d, name) if j["id"] not in seen]
        if found and found[0]["state"] in states:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no job reached {states}: {jobs(d, name)}\n{d.logs()}")


def status(d: Daemon, name: str) -> dict[str, Any]:
    """The scenario's entry in /reef/status."""
    scenarios = json.loads(d.get("/reef/status")[1])["scenarios"]
    return dict(next(s for s in scenarios if s["name"] == name))


def stop(d: Daemon) -> None:
    if d.proc is not None and d.proc.poll() is None:
        d.stop()


def test_reports_trigger_training_and_the_next_answer_comes_from_the_new_release(
        grow: Daemon, learn: Callable[..., str]) -> None:
    d, name = grow, learn(params="    max_staleness: 0\n", proof=True)
    c = client(d, name)
    receipts = [turn(d, c, f"task {i}", score=float(i % 2), name=name)[0] for i in range(4)]
    job = wait_job(d, name=name)
    assert job["state"] == "published", json.dumps(job)
    assert (job["reason"], job["receipts"]) == ("count", receipts)
    fresh = {"min": 0, "max": 0, "mean": 0.0, "off_chain": 0, "dropped": 0, "weighted": 0, "limit": 0}
    assert job["staleness"] == fresh
    assert job["progress"]["step"] == job["progress"]["steps"] >= 1
    rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
    assert rel["kind"] == "adapter" and rel["meta"]["source"] == "sao" and rel["meta"]["job"] == job["id"]
    assert rel["meta"]["receipts"] == receipts and len(rel["meta"]["reports"]) == 4
    assert rel["meta"]["gate"]["verdict"] == "pass" and "loss" in rel["meta"]["metrics"]
    # its fingerprint, made by the trainer from the saved candidate (no reference process), proven at its load
    assert len(rel["meta"]["proof"]["tokens"]) == 3 and status(d, name)["engine"]["last_proof"]["problem"] is None
    assert "reference fingerprint" not in d.log_path.read_text()
    assert turn(d, c, "after", name=name)[1] == job["release"]  # hot-swapped: the next answer names it
    # consumed records are not trained on again: a manual run finds nothing new to learn from
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 0 and "skipped: no batch ready: 0 eligible" in out.stdout, out
    # the next batch continues from the published adapter
    seen = tuple(j["id"] for j in jobs(d, name))
    for i in range(4):
        turn(d, c, f"more {i}", score=1.0, name=name)
    second = wait_job(d, seen=seen, name=name)
    assert second["id"] != job["id"] and second["state"] == "published"
    assert json.loads(d.get(f"/reef/releases/{second['release']}")[1])["parent"] == job["release"]
    listed = reefctl(d, "jobs", name)
    assert listed.returncode == 0 and second["id"] in listed.stdout and "published" in listed.stdout
    # max_staleness 0: records of the release before a promote (of that same release) are consumed unseen,
    # and the batch is the fresh ones
    old = [turn(d, c, f"old {i}", score=1.0, name=name)[0] for i in range(2)]  # 2 eligible: no job yet
    out = reefctl(d, "promote", name, second["release"], "-o", "json")
    assert out.returncode == 0, out.stderr
    promoted = json.loads(out.stdout)["release"]["id"]
    new = [turn(d, c, f"new {i}", name=name) for i in range(4)]
    assert {release for _, release, _ in new} == {promoted}
    seen = tuple(j["id"] for j in jobs(d, name))
    code, body, _ = d.post("/reef/report", {"score": 1.0, "references": [r for r, _, _ in new]},
                           headers={"x-reef-scenario": name})
    assert code == 200, body
    third = wait_job(d, seen=seen, name=name)
    assert third["state"] == "published" and third["built_on"] == promoted, third
    assert third["receipts"] == [r for r, _, _ in new] and third["skipped"] == old
    assert third["staleness"] == {**fresh, "dropped": 2}
    assert json.loads(d.get(f"/reef/releases/{third['release']}")[1])["meta"]["skipped"] == old
    listed = reefctl(d, "jobs", name)
    lines = listed.stdout.splitlines()
    assert "STALENESS" in lines[0].split() and third["id"] in lines[1] and "0 (2 dropped)" in lines[1], lines


def test_a_jobs_release_goes_on_canary_and_count_triggers_wait_for_its_decision(
        grow: Daemon, learn: Callable[..., str]) -> None:
    """With a canary declared, a job's release serves its share (here every new session) beside the release it
    replaces, the job counts as published, and count triggers wait while the release is on trial."""
    d, name = grow, learn(extra="release:\n  canary: {share: 1.0, min_reports: 50}\n")
    c = client(d, name)
    base = status(d, name)["release"]
    for i in range(4):
        turn(d, c, f"task {i}", score=float(i % 2), name=name)
    job = wait_job(d, name=name)
    assert job["state"] == "published" and not job.get("error"), json.dumps(job)
    now = status(d, name)
    assert (now["release"], now["canary"]["release"], now["canary"]["stable_release"]) == \
        (base, job["release"], base)
    assert now["releases"]["drift"] == []  # on trial beside the stable release: as declared
    assert turn(d, c, "after", name=name)[1] == job["release"]  # a new session falls on the canary's side
    for i in range(4):
        turn(d, c, f"more {i}", score=1.0, name=name)
    time.sleep(3)  # well past the count trigger's debounce: no job while the release is on trial
    assert [j["id"] for j in jobs(d, name)] == [job["id"]]


def test_a_worse_candidate_is_rejected_and_the_serving_release_stays(
        grow: Daemon, learn: Callable[..., str]) -> None:
    """The holdout tasks are the base model's own greedy answers: a candidate can at best tie, and a tie fails."""
    d, tasks_file = grow, "tasks-rejected.jsonl"
    name = learn(trigger="manual", gate="holdout", extra=f"gate:\n  tasks: {tasks_file}\n  min_tasks: 3\n"
                 "  max_tokens: 6\n", files={tasks_file: '{"prompt": "x", "answer": "placeholder"}\n' * 3})
    c = client(d, name)
    tasks = []
    for prompt in ("alpha", "beta", "gamma"):
        raw = c.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=6, temperature=0)
        tasks.append({"prompt": prompt, "answer": raw.choices[0].message.content})
    (d.scenarios / tasks_file).write_text("".join(json.dumps(t) + "\n" for t in tasks))
    before = status(d, name)["release"]
    for i in range(4):
        turn(d, c, f"task {i}", score=1.0 - i, name=name)  # inverted: the worst answers score highest
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 0, out.stderr
    job = jobs(d, name)[0]
    assert job["state"] == "rejected" and job["verdict"]["verdict"] == "fail", job
    assert job["verdict"]["current_mean"] == 1.0 and job["verdict"]["tasks"] == 3
    assert f"rejected candidate {job['release']}" in out.stdout
    now = status(d, name)
    assert now["release"] == now["releases"]["head"] == before
    assert turn(d, c, "still", name=name)[1] == before
    history = reefctl(d, "history", name, "--all")
    assert f"release {job['release']} (rejected)" in history.stdout, history.stdout
    assert job["release"] not in reefctl(d, "history", name).stdout


def test_a_failing_trainer_fails_the_job_and_publishes_nothing(grow: Daemon, learn: Callable[..., str]) -> None:
    d, name = grow, learn(trigger="manual", fault="nan")
    c = client(d, name)
    for i in range(4):
        turn(d, c, f"task {i}", score=1.0, name=name)
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 1 and "failed" in out.stdout
    job = jobs(d, name)[0]
    assert job["state"] == "failed" and "non-finite loss" in job["error"], job
    assert len(json.loads(d.get(f"/reef/scenarios/{name}/releases?all=1")[1])["data"]) == 1  # the base only
    # the records were not consumed: the batch is still there for the next (healthy) job
    assert all(r["id"] in job["receipts"]
               for r in json.loads(d.get(f"/reef/scenarios/{name}/records")[1])["data"])


def wait_step(d: Daemon, step: int = 1, timeout_s: float = 120, name: str = "learn") -> dict[str, Any]:
    """The newest job once its trainer reported `step`."""
    deadline = time.monotonic() + timeout_s
    while (job := jobs(d, name)[0])["progress"].get("step", 0) < step:
        assert job["state"] in ("queued", "running") and time.monotonic() < deadline, job
        time.sleep(0.1)
    return job


def test_cancel_and_timeout_stop_the_trainer_which_saves_its_steps_first(
        grow: Daemon, learn: Callable[..., str], tmp_path: Path) -> None:
    """`reefctl cancel` stops a job (its trainer gets SIGTERM, SIGKILL 3 s later): nothing is published and its
    records stay eligible. At `job_timeout_s` the trainer gets the same signal: it saves the steps it finished,
    and that candidate is gated and published like any other."""
    hold = tmp_path / "hold"  # the trainer waits after each step while this file exists
    hold.touch()
    d = grow
    # the timeout must come after the second job's first step, even on a busy machine (12 s did not, under load)
    name = learn(trigger="manual", recipe="  job_timeout_s: 30\n", params="    micro_batch: 2\n", fault="pause",
                 hold=hold)
    c = client(d, name)
    receipts = [turn(d, c, f"task {i}", score=float(i % 2), name=name)[0] for i in range(4)]
    head = turn(d, c, "before", name=name)[1]
    assert reefctl(d, "train", name).returncode == 0
    job = wait_step(d, name=name)
    assert job["progress"]["steps"] == 2
    out = reefctl(d, "cancel", f"job/{job['id']}")
    assert out.returncode == 0 and out.stdout == f"job/{job['id']} cancelled\n", out
    (after,) = jobs(d, name)
    assert after["state"] == "cancelled" and after["error"] == "cancelled during its train stage"
    assert not (d.state / "jobs" / job["id"]).exists()  # its folder (and what the trainer saved) is gone
    assert turn(d, c, "after", name=name)[1] == head  # nothing published; serving untouched
    again = reefctl(d, "cancel", job["id"])
    assert again.returncode == 1 and f"job {job['id']} already ended: cancelled" in again.stderr, again
    code, body, _ = d.post("/reef/jobs/j-nope/cancel", {})
    assert code == 404 and body["error"]["code"] == "job_not_found"
    # a cancel right behind the start: the job ends cancelled, and the next one runs
    code, quick, _ = d.post(f"/reef/scenarios/{name}/train", {})
    code, cancelled, _ = d.post(f"/reef/jobs/{quick['id']}/cancel", {})
    assert code == 200 and cancelled["state"] == "cancelled", cancelled
    # the records stayed eligible; this job's trainer holds after step 1 until the timeout stops it
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 0, out
    job = jobs(d, name)[0]
    assert job["state"] == "published" and job["receipts"] == receipts, job
    assert job["metrics"]["stopped"] is True and job["metrics"]["steps"] == 1, job["metrics"]
    rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
    assert rel["kind"] == "adapter" and rel["meta"]["metrics"]["stopped"] is True
    assert turn(d, c, "after", name=name)[1] == job["release"]


def test_two_triggers_at_once_make_one_job(grow: Daemon, learn: Callable[..., str]) -> None:
    d, name = grow, learn(trigger="manual", fault="hang")  # the job hangs until the test's end cancels it
    c = client(d, name)
    for i in range(4):
        turn(d, c, f"task {i}", score=1.0, name=name)
    answers: list[tuple[int, dict[str, Any]]] = []

    def trigger() -> None:
        code, body, _ = d.post(f"/reef/scenarios/{name}/train", {})
        answers.append((code, body))

    threads = [threading.Thread(target=trigger) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(code for code, _ in answers) == [200, 202]
    assert len({body["id"] for _, body in answers}) == 1
    assert len(jobs(d, name)) == 1


def test_train_refuses_a_scenario_whose_recipe_does_not_train(grow: Daemon) -> None:
    d = grow
    req = urllib.request.Request(d.url + "/reef/scenarios/tiny/train", data=b"{}", method="POST",
                                 headers={**d.headers(), "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 400
    assert json.loads(exc.value.read())["error"]["code"] == "recipe_does_not_train"


def test_an_interval_trigger_runs_jobs_on_its_own(grow: Daemon, learn: Callable[..., str]) -> None:
    d, name = grow, learn(trigger="manual", extra="trigger:\n  interval_s: 1.5\n")
    c = client(d, name)
    for i in range(4):
        turn(d, c, f"task {i}", score=1.0, name=name)
    deadline = time.monotonic() + 120
    # any of its jobs: the next interval's (skipped, nothing left to learn) may follow the published one at once
    while not (published := [j for j in jobs(d, name) if j["state"] == "published"]):
        assert time.monotonic() < deadline, f"no job published: {jobs(d, name)[:3]}\n{d.logs()}"
        time.sleep(0.2)
    (job,) = published
    assert job["reason"] == "interval" and len(job["receipts"]) == 4


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21 in make_lora
@pytest.mark.parametrize("policy", ["discard", "rebase"])
def test_a_candidate_whose_head_moved_is_discarded_or_rebased(grow: Daemon, learn: Callable[..., str],
                                                              tmp_path: Path, policy: str) -> None:
    from tests.loras import make_lora

    hold = tmp_path / "hold"  # the trainer waits while this file exists
    hold.touch()
    d = grow
    name = learn(trigger="manual", extra=f"release:\n  on_conflict: {policy}\n", fault="hold", hold=hold)
    c = client(d, name)
    for i in range(4):
        turn(d, c, f"task {i}", score=float(i % 2), name=name)
    adapter = make_lora(d.state / "models" / "tiny", tmp_path / "operator-lora", seed=5)
    assert d.post(f"/reef/scenarios/{name}/train", {})[0] == 202
    deadline = time.monotonic() + 60
    while jobs(d, name)[0]["stage"] != "train" and time.monotonic() < deadline:
        time.sleep(0.05)
    moved = reefctl(d, "publish", name, "--adapter", str(adapter), "-o", "json")  # an operator gets in first
    assert moved.returncode == 0, moved.stderr
    operator = json.loads(moved.stdout)["release"]["id"]
    assert jobs(d, name)[0]["stage"] == "train"  # still training: the operator's publish really came first
    hold.unlink()
    done = wait_job(d, name=name)
    rel = json.loads(d.get(f"/reef/releases/{done['release']}")[1])
    head = status(d, name)["releases"]["head"]
    if policy == "discard":
        assert done["state"] == "rejected" and rel["status"] == "rejected"
        assert rel["meta"]["refused"] == f"the head moved to {operator} while the candidate was built"
        assert head == operator  # the newer release was not overwritten
    else:
        assert done["state"] == "published" and rel["parent"] == operator == rel["meta"]["built_on"]
        assert rel["meta"]["rebased_from"] == done["built_on"] and head == done["release"]


def test_the_gate_scores_the_serving_release_once(tmp_path: Path) -> None:
    """A holdout gate takes the serving release's per-task scores from the gate that admitted it (same tasks,
    scorer, sampling and seeds): from memory, and after a restart from release.json. They are what generating
    gives: the admitted release, asked the gate's questions, scores the same. It restarts reefd: a reefd of its
    own."""
    d = daemon(tmp_path, trigger="manual", gate="holdout",
               extra="gate:\n  tasks: tasks.jsonl\n  min_tasks: 4\n  max_tokens: 4\n  margin: -1.0\n",
               files={"tasks.jsonl": '{"prompt": "x", "answer": "placeholder"}\n' * 4})
    prompts = ("alpha", "beta", "gamma", "delta")

    def greedy(c: openai.OpenAI) -> list[str]:
        return [c.chat.completions.create(model="learn", messages=[{"role": "user", "content": p}], max_tokens=4,
                                          temperature=0).choices[0].message.content or "" for p in prompts]

    def train(c: openai.OpenAI, n: int) -> dict[str, Any]:
        for i in range(4):
            turn(d, c, f"task {n} {i}", score=float(i % 2))
        out = reefctl(d, "train", "learn", "--follow")
        assert out.returncode == 0, out.stderr
        job = jobs(d)[0]
        assert job["state"] == "published", json.dumps(job)
        return job

    try:
        c = client(d)
        answers = greedy(c)
        (d.scenarios / "tasks.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers, strict=True)))
        first = train(c, 1)["verdict"]
        assert not first["current_reused"] and [p["current"] for p in first["per_task"]] == [1.0] * 4
        now = greedy(c)  # the first candidate serves now
        assert [p["candidate"] for p in first["per_task"]] == [float(a.strip() == b.strip())
                                                               for a, b in zip(now, answers, strict=True)]
        second = train(c, 2)["verdict"]
        assert second["current_reused"] and "current's scores from its own gate" in second["reason"]
        assert second["fingerprint"] == first["fingerprint"]
        assert [p["current"] for p in second["per_task"]] == [p["candidate"] for p in first["per_task"]]
        d.stop()
        d.start()
        third = train(c, 3)["verdict"]
        assert third["current_reused"]
        assert [p["current"] for p in third["per_task"]] == [p["candidate"] for p in second["per_task"]]
    finally:
        stop(d)


FULL = """defaults:
  - model: tiny
  - recipe: sao
  - trigger: manual
  - release: follow
  - _self_
model:
  name: tiny-full  # a model config of its own, so an engine of its own: one engine serves one set of weights
recipe:
  params: {{batch_size: 4, target: full, lr: 1.0e-4}}
gate:
  kind: floor
  tasks: {tasks}
  min_tasks: 2
  floor: 0.0
  max_tokens: 4
serve:
  default_max_tokens: 8
"""


def test_sao_with_target_full_publishes_weights_releases(grow: Daemon, own_scenario: Callable[..., str]) -> None:
    """`recipe.params.target: full`: the job trains every parameter, the gate asks the candidate on an engine of
    its own, the weights release is swapped in, and the next job trains on those weights."""
    d, tasks_file = grow, "tasks-full.jsonl"
    name = own_scenario(d, FULL.format(tasks=tasks_file), prefix="full",
                        files={tasks_file: '{"prompt": "a", "answer": "b"}\n' * 2})
    c = client(d, name)
    for i in range(4):
        turn(d, c, f"task {i}", score=float(i % 2), name=name)
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 0, out.stderr
    job = jobs(d, name)[0]
    assert job["state"] == "published", job
    assert job["verdict"]["verdict"] == "pass" and job["verdict"]["tasks"] == 2
    rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
    assert rel["kind"] == "weights" and rel["meta"]["trained_on"]["tree"] is None
    paths = {f["path"] for f in rel["files"]}
    assert {"weights/model.safetensors", "weights/config.json", "weights/objective/critic.safetensors"} <= paths
    receipt, release, _ = turn(d, c, "after", name=name)
    assert release == job["release"]
    record = json.loads(d.get(f"/reef/records/{receipt}")[1])
    assert record["weights"] == record["engine_weights"] == job["release"]
    # the next job starts from the weights that serve (and the critic saved beside them)
    for i in range(4):
        turn(d, c, f"more {i}", score=float(i % 2), name=name)
    assert reefctl(d, "train", name, "--follow").returncode == 0
    second = jobs(d, name)[0]
    assert second["state"] == "published", second
    rel2 = json.loads(d.get(f"/reef/releases/{second['release']}")[1])
    assert rel2["parent"] == job["release"] and rel2["meta"]["trained_on"]["release"] == job["release"]
    assert turn(d, c, "again", name=name)[1] == second["release"]
