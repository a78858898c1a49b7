"""A job caught by a restart or `kill -9` goes on from where it stopped, through the real daemon on the tiny
model: reefd kills itself (REEF_FAULT_KILL_AT, SIGKILL) at each boundary of one job in turn, and each restart
takes the job up from the stage its file says, until it publishes its release, once."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from reefd.grow.runner import FAULT_KILL_AT
from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_grow import client, daemon, jobs, stop, turn, wait_job
from tests.e2e.test_harness import harness_dir
from tests.e2e.test_practice import SKILL_NOTE
from tests.fake_upstream import SEEN, build
from tests.served import aiohttp_in_thread


def on_disk(d: Daemon, job_id: str) -> dict[str, Any]:
    """A job as its file says (reefd may be down)."""
    return dict(json.loads((d.state / "jobs" / f"{job_id}.json").read_text()))


def killed_at(d: Daemon, point: str, job_id: str) -> dict[str, Any]:
    """Start reefd with REEF_FAULT_KILL_AT=point; it kills itself (SIGKILL) there: the job as it left it."""
    d.env[FAULT_KILL_AT] = point
    d.start(wait_ready=False)
    assert d.proc is not None
    try:
        code = d.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"reefd never reached {point}:\n{d.logs()}") from None
    assert code == -signal.SIGKILL, d.logs()
    return on_disk(d, job_id)


def test_reefd_killed_at_each_stage_boundary_resumes_the_job_which_publishes_once(tmp_path: Path) -> None:
    """kill -9 at every boundary of one job (a test of the process: a reefd of its own). No batch yet, or no
    spec: from the start. Mid-training: trains again on the same batch. Its candidate saved: the gate runs again
    on it, not a new one; then the commit, once, even when the release was written just before the kill."""
    hold = tmp_path / "hold"  # the trainer waits while this file exists
    hold.touch()
    d = daemon(tmp_path, trigger="manual", gate="floor", fault="hold", hold=hold, env={FAULT_KILL_AT: "batch"},
               proof=True, extra="gate:\n  tasks: tasks.jsonl\n  min_tasks: 2\n  floor: 0.0\n  max_tokens: 4\n",
               files={"tasks.jsonl": '{"prompt": "one", "answer": "1"}\n{"prompt": "two", "answer": "2"}\n'})
    table = []
    try:
        c = client(d)
        for i in range(4):
            turn(d, c, f"task {i}", score=1.0)
        code, job, _ = d.post("/reef/scenarios/learn/train", {})
        assert code == 202
        job_id = job["id"]
        assert d.proc is not None and d.proc.wait(timeout=60) == -signal.SIGKILL
        table.append(("batch", on_disk(d, job_id)["stage"]))
        table.append(("train", killed_at(d, "train", job_id)["stage"]))  # started over: batch, then train
        d.env[FAULT_KILL_AT] = "gate"
        d.start(wait_ready=False)
        spec = d.state / "jobs" / job_id / "spec.json"
        deadline = time.monotonic() + 120
        while not spec.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        d.proc.kill()  # mid-training (the trainer holds); it dies with reefd
        d.proc.wait()
        batch = on_disk(d, job_id)["receipts"]
        table.append(("mid-train", on_disk(d, job_id)["stage"]))
        hold.unlink()
        gated = killed_at(d, "gate", job_id)  # trained again on the same batch; its candidate saved
        candidate = d.state / "jobs" / job_id / "candidate" / "adapter_model.safetensors"
        made = (hashlib.sha256(candidate.read_bytes()).hexdigest(), candidate.stat().st_mtime_ns)
        table.append(("gate", gated["stage"]))
        published = killed_at(d, "publish", job_id)  # the gate again, on the same candidate
        assert published["verdict"]["verdict"] == "pass" and published["verdict"]["tasks"] == 2
        assert (hashlib.sha256(candidate.read_bytes()).hexdigest(), candidate.stat().st_mtime_ns) == made
        table.append(("publish", published["stage"]))
        table.append(("committed", killed_at(d, "committed", job_id)["stage"]))  # the release written, unsaid
        d.env.pop(FAULT_KILL_AT)
        d.start()
        after = wait_job(d, ("published", "failed"))
        assert after["id"] == job_id and after["state"] == "published", after
        assert after["receipts"] == batch and len(batch) == 4 and len(jobs(d)) == 1
        assert table == [("batch", "batch"), ("train", "train"), ("mid-train", "train"), ("gate", "gate"),
                         ("publish", "publish"), ("committed", "publish")]
        # one release from the job, the one the candidate saved before the first gate, serving now
        releases = json.loads(d.get("/reef/scenarios/learn/releases?all=1")[1])["data"]
        mine = [r for r in releases if r["meta"].get("job") == job_id]
        assert [r["id"] for r in mine] == [after["release"]] and len(releases) == 2, releases
        assert turn(d, c, "after")[1] == after["release"]
        assert "was written before the restart" in d.logs()
        files = json.loads(d.get(f"/reef/releases/{after['release']}")[1])["files"]
        assert made[0] in json.dumps(files), files
    finally:
        stop(d)


BUNDLE = """defaults: [{{model: tiny}}, {{recipe: composite}}, {{trigger: manual}}, {{gate: always}},
           {{release: follow}}, _self_]
recipe:
  fault: {{kind: hold, hold: {hold}}}
  params:
    weights_params: {{batch_size: 4}}
    harness_params:
      batch_size: 4
      proposer: {{engine: upstream, url: "{url}", api_key_env: UP_KEY, upstream_model: proposer}}
harness: {{dir: bundle-harness}}
serve: {{default_max_tokens: 8}}
"""


def test_a_bundle_killed_mid_training_trains_again_beside_the_proposal_it_kept(tmp_path: Path) -> None:
    """The composite's job proposes, then trains: killed while training, the restart trains again beside the
    proposal it kept (the proposer is not asked again); killed at its gate, the gate runs again on the saved
    pair; one bundle release, with the adapter and the skill."""
    hold, answer = tmp_path / "hold", tmp_path / "answer.txt"
    hold.touch()
    answer.write_text(json.dumps(SKILL_NOTE))
    proposer = build(str(answer))
    with aiohttp_in_thread(proposer) as url:
        scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": BUNDLE.format(hold=hold,
                                                                                              url=f"{url}/v1")})
        harness_dir(scen / "bundle-harness")
        d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log", env={"UP_KEY": "up-key"},
                   proof=True)
        d.start()
        try:
            c = client(d)
            for i in range(4):
                turn(d, c, f"task {i}", score=0.0)
            code, job, _ = d.post("/reef/scenarios/learn/train", {})
            assert code == 202, job
            work = d.state / "jobs" / job["id"]
            deadline = time.monotonic() + 120
            while not (work / "spec.json").is_file() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert d.proc is not None
            d.proc.kill()  # mid-training (the trainer holds)
            d.proc.wait()
            left = on_disk(d, job["id"])
            assert (left["stage"], left["job_kind"]) == ("train", "bundle")
            assert (work / "proposal" / "skills" / "even-answers" / "SKILL.md").is_file()
            asked = len(proposer[SEEN])
            hold.unlink()
            assert killed_at(d, "gate", job["id"])["stage"] == "gate"  # trained again; the pair saved
            d.env.pop(FAULT_KILL_AT)
            d.start()
            after = wait_job(d, ("published", "failed"))
            assert after["id"] == job["id"] and after["state"] == "published", (after["error"], d.logs())
            assert len(proposer[SEEN]) == asked == 1  # proposed once
            rel = json.loads(d.get(f"/reef/releases/{after['release']}")[1])
            paths = {f["path"] for f in rel["files"]}
            assert rel["kind"] == "bundle" and "adapter/adapter_model.safetensors" in paths
            assert "harness/skills/even-answers/SKILL.md" in paths and rel["meta"]["receipts"] == after["receipts"]
        finally:
            stop(d)
