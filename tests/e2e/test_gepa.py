"""GEPA through the real daemon on the tiny model: a job answers the tasks under each candidate harness on the
scenario's engine, asks a scripted reflection model (a stand-in, labelled), keeps its archive in one JSON file, and
serves a candidate only when it beats the serving harness on validation. One reefd for the module, a scenario (with
its own harness folder and task files) per test."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, sdk, shared_daemon
from tests.e2e.test_grow import wait_job
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
    trainset: {prefix}-train.jsonl
    valset: {prefix}-val.jsonl
    scorer: tests.e2e.test_harness:length_parity
    minibatch: 3
    iterations: 3
    max_tokens: 4
    reflector: tests.recipes.reflectors:revise
    traffic_examples: 2
harness:
  dir: {prefix}-harness
serve:
  default_max_tokens: 4
"""


@pytest.fixture(scope="module")
def gepad(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The module's reefd; the scripted reflector appends the prompts it is shown to REEF_TEST_REFLECTIONS."""
    base = tmp_path_factory.mktemp("gepa")
    yield from shared_daemon(base, env={"REEF_TEST_REFLECTIONS": str(base / "reflections.jsonl"), "UP_KEY": "up-key"})


def scenario(d: Daemon, prefix: str, tasks: dict[str, tuple[int, str, str]]) -> str:
    """Writes the files of the scenario PREFIX-N that the test adds next: its harness folder PREFIX-harness and its
    task files PREFIX-NAME (`tasks`: NAME -> (how many, prompt, answer)); returns PREFIX."""
    (d.scenarios / f"{prefix}-harness" / "rules").mkdir(parents=True)
    (d.scenarios / f"{prefix}-harness" / "rules" / "style.md").write_text("Answer in one word.\n")
    for name, (n, prompt, answer) in tasks.items():
        (d.scenarios / f"{prefix}-{name}").write_text("".join(
            json.dumps({"prompt": f"{prompt} {i}", "answer": answer}) + "\n" for i in range(n)))
    return prefix


def rule(d: Daemon, name: str) -> str:
    """The serving harness's rules/style.md."""
    req = urllib.request.Request(d.url + "/reef/harness", headers={**d.headers(), "x-reef-scenario": name})
    with urllib.request.urlopen(req, timeout=30) as r:
        files = {f["path"]: f["content"] for f in json.loads(r.read())["files"]}
    return str(files["rules/style.md"]).strip()


def echo_scenario(prefix: str, url: str, component: str | None = None) -> str:
    """SCENARIO on the echo upstream at `url` (a model that repeats its instructions), scored by regex, one
    iteration a job, evolving `component` alone when one is named."""
    components = f"\n    components: [{component}]" if component else ""
    text = SCENARIO.format(prefix=prefix).replace("  - model: tiny\n", "  - model: upstream\n").replace(
        "scorer: tests.e2e.test_harness:length_parity", "scorer: regex").replace(
        "iterations: 3", f"iterations: 1{components}")
    return text + f"model:\n  url: {url}/v1\n  api_key_env: UP_KEY\n  upstream_model: echo\n"


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_gepa_jobs_keep_an_archive_and_serve_only_what_beats_the_serving_harness(
        gepad: Daemon, own_scenario: Callable[..., str]) -> None:
    d = gepad
    prefix = scenario(d, "archive", {"train.jsonl": (6, "train.jsonl question", ""),
                                     "val.jsonl": (4, "val.jsonl question", "")})
    name = own_scenario(d, SCENARIO.format(prefix=prefix), prefix=prefix)
    reflections = Path(d.env["REEF_TEST_REFLECTIONS"])
    shown_before = len(reflections.read_text().splitlines()) if reflections.exists() else 0  # other tests' jobs
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    raw = c.chat.completions.with_raw_response.create(
        model=name, messages=[{"role": "user", "content": "help"}], max_tokens=4)
    code, body, _ = d.post("/reef/report", {"references": [raw.headers["x-reef-agent-record-id"]], "score": 0.0,
                                            "feedback": "too vague, name the file"},
                           headers={"x-reef-scenario": name})
    assert code == 200, body
    archive_file = d.state / "archives" / f"{name}.json"
    seen: tuple[str, ...] = ()
    for _ in range(2):
        code, job, _ = d.post(f"/reef/scenarios/{name}/train", {}, headers={"x-reef-scenario": name})
        assert code == 202, job
        job = wait_job(d, seen=seen, name=name)
        seen += (job["id"],)
        assert job["state"] in ("published", "skipped"), job
        archive: dict[str, Any] = json.loads(archive_file.read_text())
        pool = archive["candidates"]
        serving_body = rule(d, name)
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
    prompts = [json.loads(line) for line in reflections.read_text().splitlines()[shown_before:]]
    assert len(prompts) == 6
    assert "## Generated Outputs" in prompts[0]
    assert 'Score 0.\n<untrusted source="report feedback">\ntoo vague, name the file\n</untrusted>' in prompts[0]
    assert "```\nAnswer in one word.\n```" in prompts[0]
    texts = [r["text"] for r in archive["rejected"]]
    assert len(texts) == len(set(texts))  # a rejected text is never proposed (and rejected) again


def test_a_candidate_that_beats_the_serving_harness_on_validation_is_published_and_served(
        gepad: Daemon, own_scenario: Callable[..., str]) -> None:
    """Contract test: the engine is tests/fake_upstream.py in echo mode, a stand-in for a model that repeats its
    instructions, so the harness decides the answer and the regex scorer can tell a revised harness apart."""
    d = gepad
    with aiohttp_in_thread(build(echo=True)) as url:
        prefix = scenario(d, "echo", {"train.jsonl": (4, "q", "revised"), "val.jsonl": (3, "q", "revised")})
        text = echo_scenario(prefix, url)
        name = own_scenario(d, text, prefix=prefix)
        code, job, _ = d.post(f"/reef/scenarios/{name}/train", {}, headers={"x-reef-scenario": name})
        assert code == 202, job
        job = wait_job(d, name=name)
        assert job["state"] == "published", job
        assert (job["metrics"]["serving_val"], job["metrics"]["best_val"]) == (0.0, 1.0)
        assert rule(d, name) == "Answer in one word. (revised)"
        release = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
        assert "beats the serving harness on validation: 1.000 > 0.000" in json.dumps(release)
        meta = release["meta"]
        assert meta["proposal"].startswith("# c1 (reflection on rules/style, from c0)\n") and \
            "(revised)" in meta["proposal"]
        assert meta["params"]["recipe"] == "gepa" and meta["params"]["recipe_params"]["iterations"] == 1
        # the next job finds the served candidate in its pool and has nothing better: nothing is published
        code, _, _ = d.post(f"/reef/scenarios/{name}/train", {}, headers={"x-reef-scenario": name})
        assert code == 202
        job2 = wait_job(d, seen=(job["id"],), name=name)
        assert job2["state"] == "skipped" and job2["metrics"]["serving"] == "c1", job2


def test_gepa_evolves_the_prompt_the_scenario_applies(gepad: Daemon, own_scenario: Callable[..., str]) -> None:
    """The scenario applies prompts/lead.md (harness.prompt) to what it serves; GEPA evolves that prompt alone
    (components: [prompt/lead]), and the winner is what the next request's system prompt opens with. Contract test:
    the engine is tests/fake_upstream.py in echo mode, a model that repeats its instructions."""
    d = gepad
    with aiohttp_in_thread(build(echo=True)) as url:
        prefix = scenario(d, "lead", {"train.jsonl": (4, "q", "revised"), "val.jsonl": (3, "q", "revised")})
        (d.scenarios / f"{prefix}-harness" / "prompts").mkdir()
        (d.scenarios / f"{prefix}-harness" / "prompts" / "lead.md").write_text("Start plainly.\n")
        text = echo_scenario(prefix, url, "prompt/lead").replace(
            f"  dir: {prefix}-harness\n", f"  dir: {prefix}-harness\n  prompt: lead\n")
        name = own_scenario(d, text, prefix=prefix)
        c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                              default_headers={"x-reef-scenario": name}))
        before = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert before.choices[0].message.content == "Start plainly.\n\n# Harness\n\n## Rules\n\nAnswer in one word.\n"
        code, job, _ = d.post(f"/reef/scenarios/{name}/train", {}, headers={"x-reef-scenario": name})
        assert code == 202, job
        job = wait_job(d, name=name)
        assert job["state"] == "published", job
        assert (job["metrics"]["serving_val"], job["metrics"]["best_val"]) == (0.0, 1.0)
        meta = json.loads(d.get(f"/reef/releases/{job['release']}")[1])["meta"]
        assert [(m["op"], m["kind"], m["id"]) for m in meta["mutations"]] == [("update", "prompt", "lead")]
        assert rule(d, name) == "Answer in one word."  # the rules did not change
        after = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert str(after.choices[0].message.content).startswith("Start plainly. (revised)\n\n# Harness")


def test_gepa_evolves_a_role_judged_as_its_subagent(gepad: Daemon, own_scenario: Callable[..., str]) -> None:
    """components: [role/reviewer]: the tasks are answered as the reviewer's subagent (its instructions as the system
    prompt, then the harness text), and the paired gate judges the candidate so too, since a role changes nothing
    reefd adds to served requests. The winner is a release that updates the role alone, and served requests keep
    their system prompt. Contract test: the engine is tests/fake_upstream.py in echo mode, as above."""
    d = gepad
    with aiohttp_in_thread(build(echo=True)) as url:
        prefix = scenario(d, "crew", {"train.jsonl": (4, "q", "revised"), "val.jsonl": (3, "q", "revised")})
        (d.scenarios / f"{prefix}-harness" / "roles").mkdir()
        (d.scenarios / f"{prefix}-harness" / "roles" / "reviewer.md").write_text(
            "---\nname: reviewer\ndescription: Reviews diffs\ntools: [Read]\n---\n\nReview plainly.\n")
        text = echo_scenario(prefix, url, "role/reviewer").replace("  - gate: always\n", "  - gate: paired\n")
        text += f"gate:\n  tasks: {prefix}-val.jsonl\n  scorer: regex\n  min_tasks: 3\n"
        name = own_scenario(d, text, prefix=prefix)
        code, job, _ = d.post(f"/reef/scenarios/{name}/train", {}, headers={"x-reef-scenario": name})
        assert code == 202, job
        job = wait_job(d, name=name)
        assert job["state"] == "published", job
        assert (job["metrics"]["serving_val"], job["metrics"]["best_val"]) == (0.0, 1.0)
        assert job["verdict"]["reason"].startswith("as subagent reviewer: paired on 3 tasks: 3 wins, 0 losses")
        meta = json.loads(d.get(f"/reef/releases/{job['release']}")[1])["meta"]
        assert [(m["op"], m["kind"], m["id"]) for m in meta["mutations"]] == [("update", "role", "reviewer")]
        assert meta["mutations"][0]["config"] == {"description": "Reviews diffs", "tools": ["Read"],
                                                  "body": "Review plainly. (revised)"}
        c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                              default_headers={"x-reef-scenario": name}))
        served = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert served.choices[0].message.content == "# Harness\n\n## Rules\n\nAnswer in one word.\n"
