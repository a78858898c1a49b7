"""`recipe.backend: slime` end to end, as a contract test: slime needs GPUs and Megatron-LM, so its train.py is the
stand-in at tests/fixtures/slime (slime's argument table and checks, a real gradient step, and slime's --save-hf
layout). Everything else is real: the daemon with two tiny-model replicas behind sglang-router, a Ray head of the
test's own, the job submitted through the Ray Jobs API with its batch as the working_dir package, the checkpoint
read back as a weights release, gated, published and rolled across both replicas."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_grow import client, stop, turn
from tests.e2e.test_reefctl import reefctl
from tests.e2e.test_weights import check_weights_of_answers, engine

pytestmark = [pytest.mark.contract, pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

STANDIN = Path(__file__).parents[1] / "fixtures" / "slime"
LEARN = """defaults:
  - model: tiny
  - recipe: sao
  - trigger: manual
  - gate: {gate}
  - release: follow
  - _self_
model:
  replicas: 2
recipe:
  backend:
    kind: slime
    address: {address}
    model: tiny
    path: {standin}
    python: {python}
    megatron_path: ""
    actor_num_gpus_per_node: 1
    push: {push}
  job_timeout_s: 300
  params: {{batch_size: 4, epochs: 2, micro_batch: 2, lr: 0.05}}
serve:
  default_max_tokens: 8
{extra}"""
# with push: a gate that generates, so the candidate answers on the engine slime pushed to
FLOOR = "gate:\n  tasks: tasks.jsonl\n  floor: 0.0\n  min_tasks: 2\n  max_tokens: 4\n"


@pytest.mark.parametrize("push", [False, True], ids=["train-only", "push"])
def test_a_job_trained_by_slime_is_published_as_weights_and_rolled_across_replicas(
        ray_head: tuple[str, Path], tmp_path: Path, push: bool) -> None:
    """train-only: slime trains from its rollout dump and pushes nothing; push: slime pushes every step's weights to
    an engine reefd launched for the job (its external engine), and the gate's candidate answers come from it."""
    url, token = ray_head
    log = tmp_path / "standin.jsonl"  # what the stand-in checked, one line per run
    scen = make_scenarios(tmp_path / "scenarios", names=(), extra={
        "learn": LEARN.format(address=url, standin=STANDIN, python=sys.executable, push=str(push).lower(),
                              gate="floor" if push else "always", extra=FLOOR if push else "")})
    (scen / "tasks.jsonl").write_text('{"prompt": "a", "answer": "x"}\n{"prompt": "b", "answer": "y"}\n')
    d = Daemon(scenarios=scen, state=tmp_path / "state", log_path=tmp_path / "reefd.log",
               env={"RAY_AUTH_TOKEN_PATH": str(token), "REEF_TRAIN_STANDIN_LOG": str(log)})
    d.start()
    try:
        deadline = time.monotonic() + 120
        while not all(r["in_router"] for r in engine(d, "learn")["replicas"]):
            assert time.monotonic() < deadline, engine(d, "learn")
            time.sleep(0.2)
        c = client(d)
        base = turn(d, c, "before")[1]
        receipts = [turn(d, c, f"task {i}", score=float(i % 2))[0] for i in range(4)]
        out = reefctl(d, "train", "learn", "--follow")
        assert out.returncode == 0, out.stdout + out.stderr + d.logs()
        job = json.loads(d.get("/reef/jobs?scenario=learn")[1])["data"][0]
        assert job["state"] == "published" and job["receipts"] == receipts, job
        assert job["metrics"] == {"trainer": "slime", "steps": 2, "checkpoint": "rollout_1"}

        # slime's arguments and batch, as the stand-in (slime's argument table and checks) saw them
        (ran,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert ran["problems"] == [] and [s["samples"] for s in ran["steps"]] == [4, 4]
        argv = ran["argv"]

        def arg(name: str) -> str:
            return str(argv[argv.index(name) + 1])

        assert (arg("--advantage-estimator"), arg("--rollout-batch-size"), arg("--n-samples-per-prompt"),
                arg("--global-batch-size"), arg("--num-rollout")) == ("ppo", "4", "1", "2", "2")
        assert arg("--hf-checkpoint") == arg("--ref-load") == str(d.state / "models" / "tiny")
        assert arg("--lr") == "0.05"
        rollout = str(d.state / "jobs" / job["id"] / "slime" / "rollout.pt")
        if push:  # slime's external engine: the one reefd launched for the job, on the weights it started from
            assert arg("--load-forge-rollout-data") == rollout and "--load-debug-rollout-data" not in argv
            (pushed_to,) = argv[argv.index("--rollout-external-engine-addrs") + 1:][:1]
            assert ran["engines"] == [{"url": f"http://{pushed_to}", "tp_size": 1, "pp_size": 1}]
            assert pushed_to not in {r["url"].removeprefix("http://") for r in engine(d, "learn")["replicas"]}
            assert ran["pushes"] == ["1", "2", "3"]  # before training, then after each of the 2 rollout steps
            assert "the trainer's last push (weight version 3) is on the gate's engine" in d.logs()
            assert job["verdict"]["verdict"] == "pass" and len(job["verdict"]["per_task"]) == 2
        else:
            assert arg("--load-debug-rollout-data") == rollout and "--rollout-external-engine-addrs" not in argv
        assert arg("--num-layers") == "2" and arg("--hidden-size") == "128"  # the model script's MODEL_ARGS

        # the cluster ran it, as a Ray job of that id
        req = urllib.request.Request(f"{url}/api/jobs/reef-{job['id']}",
                                     headers={"Authorization": f"Bearer {token.read_text()}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            ray_job = json.loads(r.read())
        assert ray_job["status"] == "SUCCEEDED", ray_job
        assert ray_job["runtime_env"]["working_dir"].startswith("gcs://_ray_pkg_")

        # a weights release from slime's sharded checkpoint, rolled across both replicas
        rel = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
        assert rel["kind"] == "weights" and rel["meta"]["trained_on"] == {"release": base, "tree": None}, rel
        assert rel["parent"] == base
        status = engine(d, "learn")
        assert [r["weights"] for r in status["replicas"]] == [job["release"]] * 2, status
        assert status["last_swap"]["replicas"] == 2
        answers = [turn(d, c, f"after {i}") for i in range(4)]
        assert {release for _, release, _ in answers} == {job["release"]}
        check_weights_of_answers(d, [{"receipt": r, "release": rel_} for r, rel_, _ in answers],
                                 {job["release"]: job["release"]})
    finally:
        stop(d)
