"""A user's job against faults (a test of the process: a reefd of its own): kill -9 once its release is written
resumes it on the user's line and publishes it exactly once; deleting a user whose job is training cancels the
job, stops its trainer and leaves nothing of it.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import openai

from reefd.grow.runner import FAULT_KILL_AT
from tests.conftest import Daemon, sdk
from tests.e2e.test_grow import daemon, jobs, stop, wait_job
from tests.e2e.test_reefctl import reefctl


def scored(d: Daemon, user: str, n: int) -> list[str]:
    """`n` turns of `user` in `learn`, each reported with score 1; their receipts."""
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": "learn", "x-reef-user": user}))
    out = []
    for i in range(n):
        raw = c.chat.completions.with_raw_response.create(model="learn", messages=[
            {"role": "user", "content": f"{user} asks {i}"}], max_tokens=8, temperature=1.0)
        out.append(raw.headers["x-reef-agent-record-id"])
        code, body, _ = d.post("/reef/report", {"score": 1.0, "references": [out[-1]]},
                               headers={"x-reef-scenario": "learn"})
        assert code == 200, body
    return out


def test_a_users_job_resumes_once_after_kill_9_and_is_cancelled_by_their_deletion(tmp_path: Path) -> None:
    hold = tmp_path / "hold"  # the trainer waits while this file exists
    d = daemon(tmp_path, trigger="manual", fault="hold", hold=hold, extra="users: {}\n")
    try:
        alice = scored(d, "alice", 4)
        stop(d)
        d.env[FAULT_KILL_AT] = "committed"  # reefd kills itself once the release is written, the job not told
        d.start()
        code, job, _ = d.post("/reef/scenarios/learn/train", {"user": "alice"})
        assert code == 202 and job["user"] == "alice", job
        assert d.proc is not None and d.proc.wait(timeout=180) == -signal.SIGKILL, d.logs()
        d.env.pop(FAULT_KILL_AT)
        d.start()
        done = wait_job(d, ("published", "failed"))
        assert (done["id"], done["state"], done["user"]) == (job["id"], "published", "alice"), done
        assert sorted(done["receipts"]) == sorted(alice)
        line = json.loads(d.get("/reef/scenarios/learn/releases?user=alice&all=1")[1])["data"]
        assert [r["id"] for r in line if r["meta"].get("job") == job["id"]] == [done["release"]]  # once
        assert "was written before the restart" in d.logs()

        scored(d, "bob", 4)
        hold.touch()
        code, training, _ = d.post("/reef/scenarios/learn/train", {"user": "bob"})
        assert code == 202
        deadline = time.monotonic() + 120
        while (d.state / "jobs" / training["id"] / "spec.json").is_file() is False:
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.1)
        gone = reefctl(d, "users", "delete", "learn", "bob", "-o", "json")
        assert gone.returncode == 0, gone.stderr
        answer = json.loads(gone.stdout)
        assert answer["cancelled_jobs"] == [training["id"]] and answer["releases"] == [], answer
        assert d.get(f"/reef/jobs/{training['id']}")[0] == 404  # cancelled, then forgotten with the user
        assert not (d.state / "jobs" / training["id"]).exists()
        assert [j["user"] for j in jobs(d)] == ["alice"]
        assert json.loads(d.get("/reef/scenarios/learn/releases?user=bob")[1])["own_line"] is False
    finally:
        hold.unlink(missing_ok=True)
        stop(d)
