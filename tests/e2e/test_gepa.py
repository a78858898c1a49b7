"""GEPA through the real daemon on the tiny model: a job answers the tasks under each candidate harness on the
scenario's engine, asks a scripted reflection model (a stand-in, labelled), keeps its archive in one JSON file, and
serves a candidate only when it beats the serving harness on validation."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai

from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_grow import stop, wait_job
from tests.fake_upstream import build
from tests.served import aiohttp_in_thread

SCENARIO = """defaults:
  - model: tiny
  - recipe: gepa
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    trainset: train.jsonl
    valset: val.jsonl
    scorer: tests.e2e.test_harness:length_parity
    minibatch: 3
    iterations: 3
    max_tokens: 4
    reflector: tests.recipes.reflectors:revise
    traffic_examples: 2
harness:
  dir: harness
serve:
  default_max_tokens: 4
"""


def rule(d: Daemon) -> str:
    """The serving harness's rules/style.md."""
    req = urllib.request.Request(d.url + "/reef/harness", headers={**d.headers(), "x-reef-scenario": "learn"})
    with urllib.request.urlopen(req, timeout=30) as r:
        files = {f["path"]: f["content"] for f in json.loads(r.read())["files"]}
    return str(files["rules/style.md"]).strip()


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_gepa_jobs_keep_an_archive_and_serve_only_what_beats_the_serving_harness(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": SCENARIO})
    (scen / "harness" / "rules").mkdir(parents=True)
    (scen / "harness" / "rules" / "style.md").write_text("Answer in one word.\n")
    for name, n in (("train.jsonl", 6), ("val.jsonl", 4)):
        (scen / name).write_text("".join(json.dumps({"prompt": f"{name} question {i}", "answer": ""}) + "\n"
                                         for i in range(n)))
    reflections = tmp_path / "reflections.jsonl"
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
               env={"REEF_TEST_REFLECTIONS": str(reflections)})
    d.start()
    try:
        c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                              default_headers={"x-reef-scenario": "learn"}))
        raw = c.chat.completions.with_raw_response.create(
            model="learn", messages=[{"role": "user", "content": "help"}], max_tokens=4)
        code, body, _ = d.post("/reef/report", {"references": [raw.headers["x-reef-agent-record-id"]], "score": 0.0,
                                                "feedback": "too vague, name the file"},
                               headers={"x-reef-scenario": "learn"})
        assert code == 200, body
        archive_file = tmp_path / "state" / "archives" / "learn.json"
        seen: tuple[str, ...] = ()
        for _ in range(2):
            code, job, _ = d.post("/reef/scenarios/learn/train", {}, headers={"x-reef-scenario": "learn"})
            assert code == 202, job
            job = wait_job(d, seen=seen)
            seen += (job["id"],)
            assert job["state"] in ("published", "skipped"), job
            archive: dict[str, Any] = json.loads(archive_file.read_text())
            pool = archive["candidates"]
            serving_body = rule(d)
            best = max(pool, key=lambda cand: mean(cand["val"]))
            assert all(len(cand["val"]) == 4 for cand in pool)
            if job["state"] == "published":  # served only because it beat the serving harness on validation
                assert job["metrics"]["best_val"] > job["metrics"]["serving_val"]
                assert serving_body == best["texts"]["rules/style"]
            else:
                assert "does not beat" in job["error"] and job["metrics"]["best_val"] <= job["metrics"]["serving_val"]
        assert archive["iterations"] == 6 and len(archive["log"]) == 6
        assert all(entry["component"] == "rules/style" and len(entry["minibatch"]) == 3 for entry in archive["log"])
        for entry in archive["log"]:  # each iteration: accepted (strictly better on its minibatch) or rejected
            if "accepted" in entry:
                assert sum(entry["child_scores"]) > sum(entry["parent_scores"])
            else:
                assert entry["rejected"]
        prompts = [json.loads(line) for line in reflections.read_text().splitlines()]
        assert len(prompts) == 6
        assert "## Generated Outputs" in prompts[0] and "too vague, name the file" in prompts[0]
        assert "```\nAnswer in one word.\n```" in prompts[0]
        texts = [r["text"] for r in archive["rejected"]]
        assert len(texts) == len(set(texts))  # a rejected text is never proposed (and rejected) again
    finally:
        stop(d)


def test_a_candidate_that_beats_the_serving_harness_on_validation_is_published_and_served(tmp_path: Path) -> None:
    """Contract test: the engine is tests/fake_upstream.py in echo mode, a stand-in for a model that repeats its
    instructions, so the harness decides the answer and the regex scorer can tell a revised harness apart."""
    with aiohttp_in_thread(build(echo=True)) as url:
        text = SCENARIO.replace("  - model: tiny\n", "  - model: upstream\n").replace(
            "scorer: tests.e2e.test_harness:length_parity", "scorer: regex").replace("iterations: 3", "iterations: 1")
        text += f"model:\n  url: {url}/v1\n  api_key_env: UP_KEY\n  upstream_model: echo\n"
        scen = make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": text})
        (scen / "harness" / "rules").mkdir(parents=True)
        (scen / "harness" / "rules" / "style.md").write_text("Answer in one word.\n")
        for name, n in (("train.jsonl", 4), ("val.jsonl", 3)):
            (scen / name).write_text("".join(json.dumps({"prompt": f"q {i}", "answer": "revised"}) + "\n"
                                             for i in range(n)))
        d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
                   env={"UP_KEY": "up-key"})
        d.start()
        try:
            code, job, _ = d.post("/reef/scenarios/learn/train", {}, headers={"x-reef-scenario": "learn"})
            assert code == 202, job
            job = wait_job(d)
            assert job["state"] == "published", job
            assert (job["metrics"]["serving_val"], job["metrics"]["best_val"]) == (0.0, 1.0)
            assert rule(d) == "Answer in one word. (revised)"
            release = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
            assert "beats the serving harness on validation: 1.000 > 0.000" in json.dumps(release)
            meta = release["meta"]
            assert meta["proposal"].startswith("# c1 (reflection on rules/style, from c0)\n") and \
                "(revised)" in meta["proposal"]
            assert meta["params"]["recipe"] == "gepa" and meta["params"]["recipe_params"]["iterations"] == 1
            # the next job finds the served candidate in its pool and has nothing better: nothing is published
            code, _, _ = d.post("/reef/scenarios/learn/train", {}, headers={"x-reef-scenario": "learn"})
            assert code == 202
            job2 = wait_job(d, seen=(job["id"],))
            assert job2["state"] == "skipped" and job2["metrics"]["serving"] == "c1", job2
        finally:
            stop(d)
