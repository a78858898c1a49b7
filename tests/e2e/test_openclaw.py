"""OpenClaw-RL through the real daemon on the tiny model: conversations through the official SDKs, no reports.

Turns are linked to their next state (by session header, or by a resent transcript), judged in the background
by a scripted judge (tests/recipes/judges.py), and a count trigger trains, publishes and hot-swaps a LoRA from the
judgments alone. The engine's top-K capture is in every record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anthropic
import openai

from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_grow import jobs, stop, wait_job
from tests.e2e.test_reefctl import reefctl

SCENARIO = """defaults:
  - model: tiny
  - recipe: openclaw-rl
  - trigger: count
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    batch_size: 4
    top_k: 3
    judge:
      model: tests.recipes.judges:scripted
serve:
  default_max_tokens: 6
"""
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    code, body = d.get(f"/reef/records/{receipt}")
    assert code == 200, body
    return dict(json.loads(body))


def judged(d: Daemon, receipt: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = record(d, receipt)
        if any(r.get("source") == "judge" for r in rec["reports"]):
            return rec
        time.sleep(0.1)
    raise AssertionError(f"{receipt} was never judged\n{d.logs()}")


def conversation(c: openai.OpenAI, session: str | None, user_turns: list[str]) -> list[tuple[str, str]]:
    """(receipt, answer) of each turn, the client resending the whole transcript each time."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    out = []
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        raw = c.chat.completions.with_raw_response.create(
            model="learn", messages=messages, max_tokens=6, temperature=1.0,
            extra_headers={"x-reef-session": session} if session else None)  # type: ignore[arg-type]
        answer = raw.parse().choices[0].message.content or ""
        out.append((raw.headers["x-reef-agent-record-id"], answer))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_a_lora_learns_from_judged_conversations_without_reports(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": SCENARIO})
    (scen / "trigger" / "count.yaml").write_text("every_n_records: 4\n")
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    try:
        c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                              default_headers={"x-reef-scenario": "learn"}))
        base = c.chat.completions.with_raw_response.create(
            model="learn", messages=[{"role": "user", "content": "hi"}], max_tokens=2).headers["x-reef-release-id"]
        # session A by header: a correction, then the user moves on
        a = conversation(c, "A", [QUESTIONS[0], "Please start your answer with 'OK:'.", QUESTIONS[1]])
        # a side call with A's header (a title request: another system prompt) is not a turn
        side = c.chat.completions.with_raw_response.create(
            model="learn", messages=[{"role": "system", "content": "Write a title."},
                                     {"role": "user", "content": QUESTIONS[0]}], max_tokens=4,
            extra_headers={"x-reef-session": "A"}).headers["x-reef-agent-record-id"]
        # a client with no session header that resends the transcript (linked by extension)
        b = conversation(c, None, [QUESTIONS[2], "Thanks!", "Please start your answer with 'OK:'."])
        # a client report on a turn is kept, and trains nothing
        code, body, _ = d.post("/reef/report", {"score": 1.0, "references": [a[0][0]]},
                               headers={"x-reef-scenario": "learn"})
        assert code == 200, body

        first = judged(d, a[0][0])
        assert (first["session"], first["turn"], first["turn_kind"], first["next"]) == ("A", 0, "main", a[1][0])
        assert first["next_state"] == [{"role": "user", "content": "Please start your answer with 'OK:'."}]
        verdict = next(r for r in first["reports"] if r["source"] == "judge")
        assert verdict["score"] == -1.0 and verdict["metadata"]["hints"] == ["Start every answer with 'OK:'."]
        assert verdict["metadata"]["votes"] == [-1, -1, -1]
        assert judged(d, a[1][0])["reports"][0]["score"] == 1.0  # the user moved on
        last = record(d, a[2][0])
        assert last["turn"] == 2 and last.get("next") is None  # the final turn: no next state, never judged
        side_rec = record(d, side)
        assert side_rec["turn_kind"] == "side" and side_rec["turn"] is None and side_rec["session"] == "A"
        b0 = judged(d, b[0][0])
        assert b0["session"] == f"s-{b[0][0]}" and b0["next"] == b[1][0]
        assert record(d, b[1][0])["turn"] == 1 and record(d, b[2][0])["previous"] == b[1][0]

        # the top-K capture, stored as arrays: K = 3 ids and logprobs per generated token, best first
        tokens = len(first["completion_token_ids"])
        assert first["top_k_capture"] == "full" and first["top_k"] == 3
        assert len(first["completion_top_ids"]) == len(first["completion_top_logprobs"]) == 3 * tokens
        rows = [first["completion_top_logprobs"][i * 3:(i + 1) * 3] for i in range(tokens)]
        assert all(r == sorted(r, reverse=True) and r[0] <= 0 for r in rows)

        # 4 linked turns judged (a0, a1, b0, b1) → the count trigger trains from the judgments alone
        job = wait_job(d, timeout_s=240)
        assert job["state"] == "published", json.dumps(job)
        assert job["recipe"] == "openclaw-rl"
        assert sorted(job["receipts"]) == sorted([a[0][0], a[1][0], b[0][0], b[1][0]])
        metrics = job["metrics"]
        assert metrics["rl_samples"] == 4 and metrics["opd_samples"] == 2  # the two turns a correction followed
        assert metrics["teacher_prompt_mismatches"] == 0
        rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
        assert rel["parent"] == base and rel["meta"]["source"] == "openclaw-rl"
        client_reports = {r["report_id"] for r in record(d, a[0][0])["reports"] if r["source"] == "client"}
        assert client_reports and not client_reports & set(rel["meta"]["reports"])  # only judgments trained it
        # hot-swapped: the next answer comes from the new release, through the Anthropic SDK too
        ac = sdk(anthropic.Anthropic(base_url=d.url, api_key=d.token, max_retries=0,
                                     default_headers={"x-reef-scenario": "learn"}))
        raw = ac.messages.with_raw_response.create(model="learn", max_tokens=4,
                                                   messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-reef-release-id"] == job["release"]

        out = reefctl(d, "records", "learn", "--session", "A")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:8] == ["RECEIPT", "CREATED", "API", "TOKENS", "SCORE", "TURN", "NEXT", "JUDGE"]
        row = next(line for line in lines if line.startswith(a[0][0]))
        assert a[1][0] in row and "-1 +1 hint" in row
        assert any(line.startswith(side) and " side " in line for line in lines)
        status = reefctl(d, "status")
        assert status.returncode == 0, status.stderr
        assert "scenario learn: sessions: " in status.stdout and "side calls" in status.stdout
        assert "scenario learn: judge: " in status.stdout
        st = json.loads(d.get("/reef/status")[1])["scenarios"][0]
        assert st["sessions"]["side"] == 1 and st["sessions"]["linked"] >= 4 and st["sessions"]["unlinked"] == 0
        assert st["judge"]["judged"] >= 4 and st["judge"]["negative"] >= 2 and st["judge"]["hinted"] >= 2
        assert len(jobs(d)) == 1
    finally:
        stop(d)
