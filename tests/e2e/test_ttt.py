"""TTT-Discover through the real daemon on the tiny model: the next-step route, attempts through the official SDK,
reports at grid coordinates (and the bad ones refused), the grid's job, its release, the next step's parents from
the archive on that release, a discarded grid, and the archive after a restart (also through reefctl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_grow import stop, wait_job
from tests.e2e.test_reefctl import reefctl

SCENARIO = """defaults:
  - model: tiny
  - recipe: ttt-discover
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    groups: 2
    rollouts: 3
    lr: 1.0e-3
    lora_r: 4
    lora_alpha: 8
    max_tokens: 4
    initial_state: "x = 1"
"""
LEARN = {"x-reef-scenario": "learn"}


def next_step(d: Daemon, wait: float = 0) -> tuple[int, dict[str, Any], dict[str, str]]:
    return d.post(f"/reef/scenarios/learn/attempts/next?wait={wait}", {}, headers=LEARN)


def attempt(c: openai.OpenAI, plan: dict[str, Any], group: int) -> tuple[str, str, str]:
    """(receipt, release, text) of one attempt at the group's parent state, sampled as the plan says."""
    parent = plan["parents"][group]
    raw = c.chat.completions.with_raw_response.create(
        model="learn", messages=parent["messages"], max_tokens=plan["sampling"]["max_tokens"],
        temperature=plan["sampling"]["temperature"])
    return raw.headers["x-reef-agent-record-id"], raw.headers["x-reef-release-id"], \
        raw.parse().choices[0].message.content or ""


def report(d: Daemon, receipt: str, score: Any, **meta: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    return d.post("/reef/report", {"references": [receipt], "score": score, "metadata": meta}, headers=LEARN)


def archive(d: Daemon) -> dict[str, Any]:
    code, body = d.get("/reef/scenarios/learn/archive")
    assert code == 200, body
    return dict(json.loads(body))


def error(body: dict[str, Any]) -> tuple[str | None, str]:
    return body["error"]["param"], body["error"]["message"]


def test_a_grid_trains_a_release_and_the_next_step_starts_from_it(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": SCENARIO})
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    try:
        c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0, default_headers=LEARN))
        code, plan, _ = next_step(d)
        assert code == 200, plan
        base = plan["release"]
        assert plan["step"] == 0 and plan["groups"] == 2 and plan["rollouts"] == 3
        assert [p["id"] for p in plan["parents"]] == ["root", "root"]  # one lineage: the root serves both groups
        assert "x = 1" in plan["parents"][0]["messages"][-1]["content"]
        assert next_step(d)[1] == plan  # asking again gives the same open step

        # group 0 scores 0, 1, 2; group 1 scores 1, 1, 1 (dropped: nothing to learn)
        receipts: dict[tuple[int, int], str] = {}
        for g in range(2):
            for r in range(3):
                receipt, release, _ = attempt(c, plan, g)
                assert release == base
                receipts[g, r] = receipt
        spare, _, _ = attempt(c, plan, 0)

        # bad reports: a clear 4xx naming the field, and nothing stored
        code, body, _ = d.post("/reef/report", {"references": [receipts[0, 0]], "score": 1.0,
                                                "metadata": {"step": 0, "group": 0}}, headers=LEARN)
        assert code == 400 and error(body)[0] == "metadata.rollout", body
        code, body, _ = d.post("/reef/report", {"references": [receipts[0, 0]],
                                                "metadata": {"step": 0, "group": 0, "rollout": 0}}, headers=LEARN)
        assert code == 400 and error(body)[0] == "score", body
        code, body, _ = d.post("/reef/report", b'{"references": ["%s"], "score": 1e999, "metadata": '
                               b'{"step": 0, "group": 0, "rollout": 0}}' % receipts[0, 0].encode(), headers=LEARN)
        assert code == 400 and "score" in json.dumps(body), body
        code, body, _ = report(d, receipts[0, 0], 1.0, step=7, group=0, rollout=0)
        assert code == 400 and error(body)[0] == "metadata.step" and "ahead" in error(body)[1], body
        code, body, _ = report(d, receipts[0, 0], 1.0, step=0, group=2, rollout=0)
        assert code == 400 and error(body)[0] == "metadata.group", body
        code, body, _ = report(d, receipts[0, 0], 1.0, step=0, group=0, rollout=3)
        assert code == 400 and error(body)[0] == "metadata.rollout", body
        assert d.get(f"/reef/records/{receipts[0, 0]}")[0] == 200
        assert json.loads(d.get(f"/reef/records/{receipts[0, 0]}")[1])["reports"] == []

        # the first report at a coordinate keeps it; a resend of the same report is idempotent
        code, first, _ = d.post("/reef/report", {"references": [receipts[0, 0]], "score": 0.0, "report_id": "a00",
                                                 "metadata": {"step": 0, "group": 0, "rollout": 0}}, headers=LEARN)
        assert code == 200, first
        code, again, _ = d.post("/reef/report", {"references": [receipts[0, 0]], "score": 0.0, "report_id": "a00",
                                                 "metadata": {"step": 0, "group": 0, "rollout": 0}}, headers=LEARN)
        assert code == 200 and again["report_id"] == "a00"
        code, body, _ = report(d, spare, 5.0, step=0, group=0, rollout=0)
        assert code == 409 and error(body)[0] == "metadata" and "'a00'" in error(body)[1], body
        code, body, _ = report(d, receipts[0, 0], 5.0, step=0, group=1, rollout=0)
        assert code == 409 and error(body)[0] == "references", body

        for (g, r), receipt in sorted(receipts.items()):
            if (g, r) != (0, 0):
                state = {"state": f"x = {r + 2}"} if g == 0 else {}
                code, body, _ = report(d, receipt, float(r) if g == 0 else 1.0, step=0, group=g, rollout=r,
                                       **state)
                assert code == 200, body

        job = wait_job(d, states=("published", "failed", "rejected", "skipped"))
        assert job["state"] == "published", job
        assert job["reason"] == "grid" and sorted(job["receipts"]) == sorted(receipts[0, r] for r in range(3))
        code, plan1, _ = next_step(d, wait=30)
        assert code == 200, plan1
        assert plan1["step"] == 1 and plan1["release"] == job["release"] != base
        assert plan1["parents"][0]["id"] == "s0.0.2" and plan1["parents"][0]["state"] == "x = 4"
        assert plan1["parents"][0]["score"] == 2.0
        new_release = attempt(c, plan1, 0)[1]
        assert new_release == job["release"]  # the next step's attempts are served by the grid's release
        shown = archive(d)
        step0 = shown["curve"][0]
        assert step0["state"] == "trained" and step0["produced"] == job["release"]
        assert step0["dropped"] == [1] and step0["betas"][1] is None and step0["betas"][0] > 0
        assert step0["mean"] == (0 + 1 + 2 + 1 + 1 + 1) / 6 and shown["best"]["score"] == 2.0
        rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
        meta = rel.get("meta") or rel.get("release", {}).get("meta") or rel
        assert sorted(meta["skipped"]) == sorted(receipts[1, r] for r in range(3)), rel  # consumed, not trained
        code, body, _ = report(d, spare, 1.0, step=0, group=0, rollout=1)
        assert code == 409 and error(body)[0] == "metadata.step", body

        # a release change in the middle of a step discards it, visibly
        code, _, _ = d.post("/reef/scenarios/learn/rollback", {}, headers=LEARN)
        assert code == 200
        code, plan2, _ = next_step(d)
        assert code == 200 and plan2["step"] == 2 and plan2["release"] != job["release"], plan2
        step1 = archive(d)["curve"][1]
        assert step1["state"] == "discarded" and "serving release changed" in step1["reason"], step1

        # the archive survives a restart; reefctl shows the best state and the curve
        before = archive(d)
        stop(d)
        d.start()
        after = archive(d)
        assert after["best"] == before["best"] and after["curve"] == before["curve"]
        assert after["open"]["step"] == 2
        out = reefctl(d, "archive", "learn")
        assert out.returncode == 0, out.stderr
        assert "BEST s0.0.2" in out.stdout and "x = 4" in out.stdout
        assert "trained" in out.stdout and "discarded" in out.stdout
        status = reefctl(d, "status")
        assert "search: step 2 (open), 2 steps closed (1 discarded), best 2.0" in status.stderr + status.stdout
    finally:
        stop(d)

