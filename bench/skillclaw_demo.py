"""SkillClaw on SmolLM2, end to end through reefd: agent feedback → proposer → skill edits → paired gate.

A scenario serves SmolLM2 with a small coding-agent harness (one rule, one skill). The demo sends a few
turns through the official `openai` SDK, reports each with a low score and the same textual feedback
("explain how to write a commit message"), then runs `reefctl train --follow`. The proposer is the
scenario's own engine (SmolLM2-135M, on this CPU), so the demo shows what such a small model proposes
and what Reef does with it: a valid proposal goes through the paired gate and may be published; an
answer that is not the required JSON is refused and nothing is published. It prints the job's outcome,
the proposer's answer (truncated), and, when a release was made, `reefctl diff` of the harness.

Run: python bench/skillclaw_demo.py   (make demo runs it; about 2-4 minutes)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, Daemon, scratch_dir

from tests.conftest import make_scenarios

SCENARIO = """defaults:
  - model: smollm2
  - recipe: skillclaw
  - trigger: manual
  - gate: paired
  - release: follow
  - _self_
recipe:
  params:
    batch_size: 4
    max_tokens: 384
gate:
  tasks: coder-tasks.jsonl
  min_tasks: 4
  max_tokens: 48
  scorer: bench.skillclaw_tasks:mentions_commit
  min_win_margin: 0
harness:
  dir: coder-harness
serve:
  temperature: 0.2
  default_max_tokens: 64
"""
QUESTIONS = ["How should I save my work in git?", "I changed two files, what now?",
             "What do I write when I commit?", "My teammate says my commit messages are bad. Why?"]
FEEDBACK = "The answer should explain how to write a good commit message: a short summary line, then why."


def start(tmp: Path) -> Daemon:
    from reefd.worker.prepare import prepare

    scen = make_scenarios(tmp / "scenarios", names=(), extra={"coder": SCENARIO})
    (scen / "coder-harness" / "rules").mkdir(parents=True)
    (scen / "coder-harness" / "rules" / "style.md").write_text("Answer in at most three sentences.\n")
    skill = scen / "coder-harness" / "skills" / "git-basics"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: git-basics\ndescription: Saving work with git add and git commit."
                                    "\n---\n\nStage changes with git add, then record them with git commit.\n")
    (scen / "coder-tasks.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": "commit"}) + "\n"
                                                    for q in QUESTIONS))
    state = tmp / "state"
    home = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    (state / "models").mkdir(parents=True)
    (state / "models" / "smollm2").symlink_to(prepare("smollm2", home / "models" / "smollm2"))
    d = Daemon(scenarios=scen, state=state, log_path=tmp / "reefd.log")
    d.start(wait_ready=False)
    d.wait_ready(600)
    return d


def reefctl(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REEF_URL": d.url, "REEF_TOKEN": d.token}
    return subprocess.run([sys.executable, "-m", "reefd.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=1800)


def main() -> int:
    import openai

    tmp = scratch_dir()
    d = start(tmp)
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                               default_headers={"x-reef-scenario": "coder"})
        for q in QUESTIONS:
            raw = client.chat.completions.with_raw_response.create(
                model="coder", messages=[{"role": "user", "content": q}], max_tokens=64)
            answer = raw.parse().choices[0].message.content or ""
            print(f"agent turn: {q!r} -> {answer[:80]!r}")
            code, body, _ = d.post("/reef/report", {"score": 0.0, "feedback": FEEDBACK,
                                                    "references": [raw.headers["x-reef-agent-record-id"]]},
                                   headers={"x-reef-scenario": "coder"})
            assert code == 200, body
        client.close()
        base = json.loads(d.get("/reef/harness?scenario=coder")[1])["release"]
        started = time.monotonic()
        out = reefctl(d, "train", "coder", "--follow", "-o", "json")
        job: dict[str, Any] = json.loads(out.stdout)
        seconds = time.monotonic() - started
        print(f"\nSkillClaw job {job['id']}: {job['state']} in {seconds:.0f} s"
              + (f" ({job['error']})" if job.get("error") else ""))
        answer = (job.get("metrics") or {}).get("proposer_answer", "")
        print(f"proposer (SmolLM2) answered: {answer[:600]!r}")
        if job.get("verdict"):
            print(f"paired gate: {job['verdict']['reason']}")
        changed: list[str] = []
        if job.get("release"):
            diff = reefctl(d, "diff", base, job["release"])
            print(f"\nreefctl diff {base} {job['release']}:\n{diff.stdout}")
            changed = json.loads(reefctl(d, "diff", base, job["release"], "-o", "json").stdout)["changed"]
        print(json.dumps({"bench": "skillclaw_demo", "model": "smollm2", "job_state": job["state"],
                          "seconds": round(seconds, 1), "release": job.get("release"),
                          "reason": job.get("error") or (job.get("verdict") or {}).get("reason"),
                          "changed_files": changed}))
        # the goal is the pipeline's: the job ends as published, rejected by the gate or refused with a reason,
        # never failed (what SmolLM2 proposes is whatever it is)
        if job["state"] not in ("published", "rejected", "skipped") or (job["state"] == "published" and not changed):
            print(f"skillclaw_demo: goal missed (job {job['state']}: {job.get('error')})", file=sys.stderr)
            return 1
        return 0
    finally:
        d.stop()
        log = (tmp / "reefd.log").read_text(errors="replace")
        if "Traceback" in log:
            print(log[-3000:], file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
