"""A recipe of a user's own, defined only under tests/ and named by dotted path in a scenario, trains and
publishes through the real daemon: its trainer-side objective (plain REINFORCE) is loaded by the generic trainer
from the path in the job spec, with no change to reefd/."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import ROOT, Daemon, make_scenarios
from tests.e2e.test_grow import client, jobs, stop, turn
from tests.e2e.test_reefctl import reefctl

RECIPE = "tests.recipes.reinforce.recipe:Reinforce"
SCENARIO = f"""defaults:
  - model: tiny
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  name: {RECIPE}
  params:
    batch_size: 4
serve:
  default_max_tokens: 8
"""


def test_a_recipe_from_tests_trains_and_publishes_through_the_daemon(tmp_path: Path) -> None:
    # whole words: slime's estimator names (reinforce_plus_plus, in reefd/grow/backends/slime.py) are not this recipe
    found = subprocess.run(["git", "grep", "-ilw", "-e", "reinforce", "-e", "tests.recipes", "--", "reefd", "recipes",
                            ":!*.md"], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 1 and found.stdout == "", f"code in reefd/ or recipes/ names it: {found.stdout}"
    d = Daemon(scenarios=make_scenarios(tmp_path / "scenarios", names=(), extra={"learn": SCENARIO}),
               state=tmp_path / "state", log_path=tmp_path / "reefd.log")
    d.start()
    try:
        c = client(d)
        base = turn(d, c, "hello")[1]
        receipts = [turn(d, c, f"task {i}", score=float(i % 2))[0] for i in range(4)]
        out = reefctl(d, "train", "learn", "--follow")
        assert out.returncode == 0, out.stderr
        job = jobs(d)[0]
        assert job["state"] == "published", json.dumps(job)
        assert job["recipe"] == RECIPE and job["receipts"] == receipts
        metrics = job["metrics"]  # the objective's own metrics, from the trainer's done line
        assert metrics["objective"] == "reinforce" and metrics["baseline"] == 0.5 and metrics["objective_steps"] == 1
        assert job["progress"]["baseline"] == 0.5 and job["progress"]["step"] == 1
        rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
        assert rel["kind"] == "adapter" and rel["parent"] == base and rel["meta"]["source"] == RECIPE
        files = {f["path"] for f in rel["files"]}
        assert {"adapter/adapter_model.safetensors", "adapter/reinforce.json"} <= files  # the objective's save()
        assert turn(d, c, "after")[1] == job["release"]  # hot-swapped: the next answer comes from it
    finally:
        stop(d)
