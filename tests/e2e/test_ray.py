"""`recipe.backend: ray` for real: a local Ray head started as a child process (`ray start --head --block`, its
own --temp-dir, bound to loopback, token auth), a Grow job on the tiny model submitted through the Ray Jobs API,
its progress relayed, its adapter gated, published and served. The head is ended by its PID, never `ray stop`
(which would stop every Ray process on the machine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_grow import client, stop, turn
from tests.e2e.test_reefctl import reefctl

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

LEARN = """defaults:
  - model: tiny
  - recipe: sao
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  backend: {{kind: ray, address: "{address}"}}
  job_timeout_s: 300
  params: {{batch_size: 4}}
{fault}serve:
  default_max_tokens: 8
"""


def fault(kind: str, hold: Path) -> str:
    """The trainer's test fault, as the scenario declares it (it travels with the job's spec)."""
    return f"  fault: {{kind: {kind}, hold: {hold}}}\n"


def test_a_grow_job_runs_as_a_ray_job(ray_head: tuple[str, Path], tmp_path: Path) -> None:
    url, token = ray_head
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={
        "learn": LEARN.format(address=url, fault=""), "unreachable": LEARN.format(address="http://127.0.0.1:9",
                                                                                   fault=""),
        "mine": LEARN.format(address=url, fault="") + "users:\n  slots: 2\n"})
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
               env={"RAY_AUTH_TOKEN_PATH": str(token)})
    d.start()
    try:
        c = client(d)
        receipts = [turn(d, c, f"task {i}", score=float(i % 2))[0] for i in range(4)]
        out = reefctl(d, "train", "learn", "--follow")
        assert out.returncode == 0, out.stdout + out.stderr
        job = json.loads(d.get("/reef/jobs?scenario=learn")[1])["data"][0]
        assert job["state"] == "published", job
        assert job["receipts"] == receipts and job["progress"]["step"] == job["progress"]["steps"] >= 1
        assert "loss" in job["metrics"]
        # the cluster ran it: the Ray job of that id succeeded
        req = urllib.request.Request(f"{url}/api/jobs/reef-{job['id']}",
                                     headers={"Authorization": f"Bearer {token.read_text()}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            ray_job = json.loads(r.read())
        assert ray_job["status"] == "SUCCEEDED" and ray_job["metadata"] == {"reef_job": job["id"]}
        assert turn(d, c, "after")[1] == job["release"]  # served: the next answer names the new release

        # an unreachable cluster: a failed job saying so, nothing published, serving untouched
        c2 = client(d).with_options(default_headers={"x-reef-scenario": "unreachable"})
        before = turn(d, c2, "x")[1]
        for i in range(4):
            raw = c2.chat.completions.with_raw_response.create(
                model="unreachable", messages=[{"role": "user", "content": f"t{i}"}], max_tokens=4)
            receipt = raw.headers["x-reef-agent-record-id"]
            assert d.post("/reef/report", {"score": 1.0, "references": [receipt]},
                          headers={"x-reef-scenario": "unreachable"})[0] == 200
        out = reefctl(d, "train", "unreachable", "--follow")
        failed = json.loads(d.get("/reef/jobs?scenario=unreachable")[1])["data"][0]
        assert failed["state"] == "failed" and "cannot reach the Ray cluster at http://127.0.0.1:9" in \
            failed["error"], failed
        assert json.loads(d.get("/reef/scenarios/unreachable/releases")[1])["head"] == before
        users_jobs_fan_out(d, url, token)
    finally:
        stop(d)


def users_jobs_fan_out(d: Daemon, url: str, token: Path) -> None:
    """Per-user learning on the Ray backend: alice's and bob's jobs are Ray jobs of their own, submitted together,
    each trained on its user's records alone and published to its user's line, which serves that user only."""
    shared = client(d, "mine")
    receipts: dict[str, list[str]] = {}
    for user in ("alice", "bob"):
        c = shared.with_options(default_headers={"x-reef-scenario": "mine", "x-reef-user": user})
        receipts[user] = [turn(d, c, f"{user} {i}", score=float(i % 2), name="mine")[0] for i in range(4)]
    for user in receipts:
        out = reefctl(d, "train", "mine", "--user", user)
        assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = json.loads(d.get("/reef/jobs?scenario=mine")[1])["data"]
        if len(done) == 2 and all(j["state"] in ("published", "failed", "rejected") for j in done):
            break
        time.sleep(0.5)
    by_user = {j["user"]: j for j in done}
    assert set(by_user) == {"alice", "bob"} and all(j["state"] == "published" for j in done), done
    for user, job in by_user.items():
        assert job["receipts"] == receipts[user], job  # their own records alone
        ray_job = ray_get(url, token, f"/api/jobs/reef-{job['id']}")
        assert isinstance(ray_job, dict) and ray_job["status"] == "SUCCEEDED", ray_job
        c = shared.with_options(default_headers={"x-reef-scenario": "mine", "x-reef-user": user})
        assert turn(d, c, "after", name="mine")[1] == job["release"]
    assert turn(d, shared, "nobody's", name="mine")[1] not in {j["release"] for j in done}


def ray_get(url: str, token: Path, path: str) -> object:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token.read_text()}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_a_restart_mid_job_follows_the_ray_job_instead_of_training_twice(ray_head: tuple[str, Path],
                                                                          tmp_path: Path) -> None:
    url, token = ray_head
    hold = tmp_path / "hold"
    hold.write_text("")  # the trainer waits while this file exists (the fault travels with the job's spec)
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={
        "learn": LEARN.format(address=url, fault=fault("hold", hold))})
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
               env={"RAY_AUTH_TOKEN_PATH": str(token)})
    d.start()
    try:
        c = client(d)
        receipts = [turn(d, c, f"task {i}", score=float(i % 2))[0] for i in range(4)]
        assert reefctl(d, "train", "learn").returncode == 0
        deadline = time.monotonic() + 120
        while True:
            jobs = json.loads(d.get("/reef/jobs?scenario=learn")[1])["data"]
            if jobs and jobs[0]["stage"] == "train" and jobs[0]["progress"] == {}:
                with contextlib.suppress(OSError):
                    if ray_get(url, token, f"/api/jobs/reef-{jobs[0]['id']}")["status"] == "RUNNING":  # type: ignore[index]
                        break
            assert time.monotonic() < deadline, jobs
            time.sleep(0.3)
        job_id = jobs[0]["id"]
        d.stop()  # reefd goes; the Ray job goes on, held
        saved = json.loads((d.state / "jobs" / f"{job_id}.json").read_text())
        assert saved["state"] == "running" and saved["detachable"] is True
        d.start()
        hold.unlink()  # the held trainer goes on
        deadline = time.monotonic() + 180
        while (job := json.loads(d.get(f"/reef/jobs/{job_id}")[1]))["state"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.3)
        assert job["state"] == "published" and job["receipts"] == receipts, job
        submitted = [j for j in ray_get(url, token, "/api/jobs/")  # type: ignore[union-attr]
                     if j["submission_id"] == f"reef-{job_id}"]
        assert len(submitted) == 1 and submitted[0]["status"] == "SUCCEEDED"  # trained once, followed twice
        assert turn(d, c, "after")[1] == job["release"]
    finally:
        stop(d)


def test_a_wrong_token_fails_the_job_with_a_clear_message(ray_head: tuple[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from reefd.grow.backends.ray_jobs import RayConfig, RayJobs

    url, _ = ray_head
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"job": "j-wrong-token"}))
    events: list[dict[str, object]] = []

    async def go() -> int:
        backend = RayJobs(tmp_path, 1, RayConfig(address=url))
        try:
            return await backend.run(spec, events.append, 60)
        finally:
            await backend.close()

    assert asyncio.run(go()) == 1
    assert events == [{"event": "error", "reason": f"the Ray cluster at {url} refused reefd's token (403); set "
                                                   "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or the ray-token credential"}]


def ray_job(url: str, token: Path, submission: str, states: tuple[str, ...], timeout_s: float = 60) -> dict:
    """The Ray job once it is in one of `states`."""
    deadline = time.monotonic() + timeout_s
    while (info := ray_get(url, token, f"/api/jobs/{submission}"))["status"] not in states:  # type: ignore[index]
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
    return dict(info)  # type: ignore[arg-type]


def test_cancel_stops_the_ray_job_and_its_trainer_saves_first(ray_head: tuple[str, Path], tmp_path: Path) -> None:
    url, token = ray_head
    hold = tmp_path / "hold"  # the trainer waits after each step while this exists
    hold.write_text("")
    learn = LEARN.format(address=url, fault=fault("pause", hold)).replace("{batch_size: 4}",
                                                                          "{batch_size: 4, micro_batch: 2}")
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": learn})
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
               env={"RAY_AUTH_TOKEN_PATH": str(token)})
    d.start()
    try:
        c = client(d)
        head = turn(d, c, "before")[1]
        for i in range(4):
            turn(d, c, f"task {i}", score=float(i % 2))
        assert reefctl(d, "train", "learn").returncode == 0
        deadline = time.monotonic() + 120
        while (job := json.loads(d.get("/reef/jobs?scenario=learn")[1])["data"][0])["progress"].get("step") != 1:
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
        out = reefctl(d, "cancel", job["id"])
        assert out.returncode == 0 and out.stdout == f"job/{job['id']} cancelled\n", out
        after = json.loads(d.get(f"/reef/jobs/{job['id']}")[1])
        assert after["state"] == "cancelled" and after["error"] == "cancelled during its train stage"
        ray = ray_job(url, token, f"reef-{job['id']}", ("STOPPED",))
        assert ray["status"] == "STOPPED"
        logs = ray_get(url, token, f"/api/jobs/reef-{job['id']}/logs")["logs"]  # type: ignore[index]
        # the trainer heard SIGTERM and saved its step before Ray's SIGKILL (3 s later)
        assert "terminated by SIGTERM after 1 of 2 steps; the steps done are saved" in logs, logs[-2000:]
        assert turn(d, c, "after")[1] == head  # nothing published
    finally:
        stop(d)


def run_backend(url: str, spec: Path, timeout_s: float, **kw: object) -> tuple[int, list[dict[str, object]]]:
    from reefd.grow.backends.ray_jobs import RayConfig, RayJobs

    events: list[dict[str, object]] = []

    async def go() -> int:
        backend = RayJobs(spec.parent, 1, RayConfig(address=url, **kw))  # type: ignore[arg-type]
        try:
            return await backend.run(spec, events.append, timeout_s)
        finally:
            await backend.close()

    return asyncio.run(go()), events


def test_a_job_that_fails_on_the_cluster_shows_its_message_and_log(ray_head: tuple[str, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, token = ray_head
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"job": "j-bad-spec", "objective": "recipes.sao.objective:SAOObjective"}))
    code, events = run_backend(url, spec, 120)
    assert code == 2  # the trainer's own exit status: a bad spec
    reason = str(events[-1]["reason"])
    assert reason.startswith("the Ray job reef-j-bad-spec failed: Job entrypoint command failed with exit code 2 "
                             "| log: "), reason  # the cluster's message, then the tail of the job's log
    assert reason.endswith(' | {"event": "error", "reason": "bad spec: base_model: missing"}'), reason


def test_a_job_the_cluster_never_starts_fails_at_its_timeout(ray_head: tuple[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url, token = ray_head
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"job": "j-no-gpu"}))
    started = time.monotonic()
    code, events = run_backend(url, spec, 4, resources={"num_gpus": 1})  # the test head has no GPU
    assert code == 1 and time.monotonic() - started < 30
    assert str(events[-1]["reason"]).startswith(f"the Ray job reef-j-no-gpu did not start within 4 s: the cluster "
                                                f"at {url} has no room for it (it asks for num_gpus 1)"), events
    # Ray queues the stop on the job's supervisor, which waits for the same GPU: the job stays pending, and stops
    # the moment it could start (Ray fails it after RAY_JOB_START_TIMEOUT_SECONDS, 15 min, anyway)
    assert ray_get(url, token, "/api/jobs/reef-j-no-gpu")["status"] == "PENDING"  # type: ignore[index]
