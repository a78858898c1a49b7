"""The Tinker API, driven by the unmodified `tinker` SDK (0.38.0, the version the `tinker` extra pins) against a
real reefd on the tiny model: a cookbook-style supervised loop run as a script of its own, the loss functions,
checkpoints saved and loaded (also by a new training client, as a resumed cookbook run does), and the refusals
the SDK gets for bad input, missing scopes and bounds."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import ROOT, Daemon, shared_daemon
from tests.e2e.test_tokens import reefctl

# the SDK's background event loop drops connections of its own pool unclosed when a session ends (its sockets, not
# reefd's): their ResourceWarnings reach pytest as unraisable exceptions
pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
SL_LOOP = ROOT / "tests" / "tinker" / "sl_loop.py"
# a scenario whose holdout tasks are its base model's own greedy answers (written by the test): a candidate can at
# best tie, and a tie fails
STRICT = ("defaults:\n  - model: tiny\n  - gate: holdout\n  - _self_\n"
          "gate:\n  tasks: tasks-strict.jsonl\n  min_tasks: 3\n  max_tokens: 6\n")
PLACEHOLDER = '{"prompt": "x", "answer": "placeholder"}\n'


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("tinker"), env={"REEF_TINKER_MODELS": "3"},
                             extra={"strict": STRICT}, files={"tasks-strict.jsonl": PLACEHOLDER * 3})
    gc.collect()  # the SDK's dropped sockets go here, under this module's filter, not in a later module's test


@pytest.fixture
def client(d: Daemon) -> Iterator[tinker.ServiceClient]:
    """A session of the test's own: closing it stops its models' trainers (at most Limits.models at once)."""
    os.environ["TINKER_TELEMETRY"] = "0"
    service = tinker.ServiceClient(base_url=d.url, api_key="tml-" + d.token)
    yield service
    service.close("success").result()


def sdk_env(d: Daemon, key: str | None = None) -> dict[str, str]:
    """What a Tinker script's environment says to point it at reefd: nothing else changes."""
    return {**os.environ, "TINKER_BASE_URL": d.url, "TINKER_API_KEY": "tml-" + (key or d.token),
            "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": w})


DATA = [datum([5, 17, 29, 41, 53, 65, 77]), datum([9, 8, 7, 6, 5], [0.0, 0.0, 1.0, 1.0])]


def nll(result: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    lp = np.concatenate([o["logprobs"].to_numpy() for o in result.loss_fn_outputs])
    w = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in data])
    return float(-np.dot(lp, w) / w.sum())


def test_a_cookbook_style_supervised_loop_runs_unmodified_and_learns(d: Daemon) -> None:
    out = subprocess.run([sys.executable, str(SL_LOOP)], env={**sdk_env(d), "STEPS": "6"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:] + d.logs()
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    steps, saved = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == list(range(6))
    assert steps[-1]["nll"] < steps[0]["nll"] - 0.5, steps  # it learns its four answers
    assert all(s["optim"]["step:max"] == i + 1 for i, s in enumerate(steps))
    for key, kind in (("state_path", "weights"), ("sampler_path", "sampler_weights")):
        run, where, name = saved[key].removeprefix("tinker://").split("/")
        assert (where, name) == (kind, "final")
        folder = d.state / "tinker" / "runs" / run / kind / "final"
        assert (folder / "adapter_model.safetensors").is_file(), sorted(folder.parent.iterdir())
        assert json.loads((folder / "meta.json").read_text())["steps"] == 6
    assert (d.state / "tinker" / "runs" / run / "weights" / "final" / "optimizer.pt").is_file()
    assert not (d.state / "tinker" / "runs" / run / "sampler_weights" / "final" / "optimizer.pt").exists()
    # the sampler's checkpoint is a candidate: the scenario's gate (always) admits it, and it serves
    job = wait_job(d, "tiny")
    assert (job["reason"], job["state"]) == ("offered", "published"), job
    meta = json.loads(d.get(f"/reef/releases/{job['release']}")[1])["meta"]
    assert meta["source"] == "tinker" and meta["tinker"]["checkpoint"] == saved["sampler_path"]
    assert meta["tinker"]["steps"] == 6
    assert served_by(d, "tiny") == job["release"]


def wait_job(d: Daemon, scenario: str, timeout_s: float = 180) -> dict[str, Any]:
    """The scenario's newest job once it ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = json.loads(d.get(f"/reef/jobs?scenario={scenario}")[1])["data"]
        if found and found[0]["state"] not in ("queued", "running"):
            return dict(found[0])
        time.sleep(0.2)
    raise AssertionError(f"no job of {scenario} ended\n{d.logs()}")


def served_by(d: Daemon, scenario: str) -> str:
    status, body, headers = d.post("/v1/chat/completions", {"model": scenario, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"x-reef-scenario": scenario})
    assert status == 200, body
    return str({k.lower(): v for k, v in headers.items()}["x-reef-release-id"])


def test_every_loss_trains_and_forward_changes_nothing(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    before = tc.forward(DATA, "cross_entropy").result()
    again = tc.forward(DATA, "cross_entropy").result()
    assert nll(before, DATA) == nll(again, DATA)  # forward accumulates no gradient: nothing to step on
    lp = [o["logprobs"].tolist() for o in before.loss_fn_outputs]
    assert [len(x) for x in lp] == [6, 4]
    assert math.isclose(before.metrics["loss:sum"], -sum(np.dot(a, d.loss_fn_inputs["weights"].tolist())
                                                         for a, d in zip(lp, DATA, strict=True)), rel_tol=1e-5)
    rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": old,
        "advantages": [1.0] * len(old)}) for d, old in zip(DATA, lp, strict=True)]
    for loss, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9,
                                                                 "clip_high_threshold": 1.1}),
                         ("cispo", None), ("dro", {"beta": 0.1})):
        result = tc.forward_backward(rl, loss, loss_fn_config=config).result()
        assert math.isfinite(result.metrics["loss:sum"]), loss
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward(DATA, "cross_entropy").result()
    assert nll(after, DATA) < nll(before, DATA)  # positive advantages on DATA's own tokens: more likely now


def test_a_saved_state_resumes_in_a_new_client_exactly(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("resume-me").result().path
    trained = tc.forward(DATA, "cross_entropy").result()
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    same = resumed.forward(DATA, "cross_entropy").result()
    assert [o["logprobs"].tolist() for o in same.loss_fn_outputs] == \
        [o["logprobs"].tolist() for o in trained.loss_fn_outputs]
    for c in (tc, resumed):  # the optimizer state came along: one more step moves both alike
        c.forward_backward(DATA, "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert nll(tc.forward(DATA, "cross_entropy").result(), DATA) == \
        pytest.approx(nll(resumed.forward(DATA, "cross_entropy").result(), DATA), abs=1e-5)


def test_saving_over_a_checkpoint_fails_and_keeps_it(d: Daemon, client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_state("keep").result().path
    folder = d.state / "tinker" / "runs" / path.removeprefix("tinker://").split("/")[0] / "weights" / "keep"
    kept = (folder / "adapter_model.safetensors").read_bytes()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    with pytest.raises(tinker.RequestFailedError, match="exists already") as exc:
        tc.save_state("keep").result()
    assert exc.value.category == "user"
    assert (folder / "adapter_model.safetensors").read_bytes() == kept


def post(d: Daemon, path: str, body: dict[str, Any], key: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(d.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"X-API-Key": "tml-" + (key or d.token),
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


SHORT = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]})
BAD = {  # a wrong shape, a token id outside the vocabulary, an unknown loss and setting, a NaN learning rate
    "shape": (lambda tc: tc.forward_backward([SHORT], "cross_entropy"), r"2 values for 3 positions"),
    "vocabulary": (lambda tc: tc.forward_backward([datum([1, 2, 999_999])], "cross_entropy"),
                   "outside the model's vocabulary"),
    "loss": (lambda tc: tc.forward_backward(DATA, "nope"), "not one reefd runs"),
    "setting": (lambda tc: tc.forward_backward(DATA, "ppo", loss_fn_config={"clip": 0.2}), "not 'clip'"),
    "nan": (lambda tc: tc.optim_step(types.AdamParams(learning_rate=float("nan"))), "learning_rate"),
}


@pytest.mark.parametrize(("call", "match"), list(BAD.values()), ids=list(BAD))
def test_bad_input_is_a_400_the_sdk_raises_at_once(client: tinker.ServiceClient, call: Any, match: str) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=match):
        call(tc).result()


def test_a_loss_that_overflows_fails_its_future_as_the_callers(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    huge = datum([5, 17, 29], [3e38, 3e38])  # finite weights, whose weighted loss is not
    with pytest.raises(tinker.RequestFailedError, match="not finite") as exc:
        tc.forward_backward([huge], "cross_entropy").result()
    assert exc.value.category == "user"


def test_unknown_checkpoints_and_futures_are_not_found(d: Daemon, client: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        client.create_training_client_from_state("tinker://nobody/weights/none").result()
    assert post(d, "/api/v1/retrieve_future", {"request_id": "never-made"})[0] == 404


def test_a_future_answers_as_often_as_it_is_asked(d: Daemon, client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    model_id = tc.get_info().model_id
    status, sent = post(d, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "type": "optim_step",
                                                  "adam_params": {"learning_rate": 1e-3, "beta1": 0.9,
                                                                  "beta2": 0.95, "eps": 1e-12}})
    assert status == 200, sent
    again = post(d, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "type": "optim_step",
                                           "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95,
                                                           "eps": 1e-12}})[1]
    assert again["request_id"] == sent["request_id"]  # sent again after a timeout: the same request
    answers = [post(d, "/api/v1/retrieve_future", {"request_id": sent["request_id"]})[1] for _ in range(2)]
    assert answers[0] == answers[1] and answers[0]["metrics"]["step:max"] == 1


def test_a_token_without_train_scope_cannot_train(d: Daemon) -> None:
    made = reefctl(d.state, "token", "create", "chat-only", "--scope", "serve,report")
    assert made.returncode == 0, made.stderr
    d.reload()
    service = tinker.ServiceClient(base_url=d.url, api_key="tml-" + made.stdout.strip())
    try:
        with pytest.raises(tinker.PermissionDeniedError, match="train"):
            service.create_lora_training_client(base_model="tiny", rank=4).result()
    finally:
        service.close("success").result()
    assert post(d, "/api/v1/create_session", {}, key=made.stdout.strip())[0] == 403
    elsewhere = reefctl(d.state, "token", "create", "train-elsewhere", "--scope", "train", "--scenario", "other")
    assert elsewhere.returncode == 0, elsewhere.stderr
    d.reload()
    service = tinker.ServiceClient(base_url=d.url, api_key="tml-" + elsewhere.stdout.strip())
    try:  # a train token limited to another scenario: the scenario is named by base_model
        with pytest.raises(tinker.PermissionDeniedError, match="may not use scenario 'tiny'"):
            service.create_lora_training_client(base_model="tiny", rank=4).result()
    finally:
        service.close("success").result()


def test_models_are_bounded_with_a_clear_refusal(d: Daemon, client: tinker.ServiceClient) -> None:
    """At most three trainers at once (REEF_TINKER_MODELS here); the fourth is refused at once, not retried for
    minutes."""
    held = [tinker.ServiceClient(base_url=d.url, api_key="tml-" + d.token) for _ in range(3)]
    try:
        for service in held:
            service.create_lora_training_client(base_model="tiny", rank=2).result()
        with pytest.raises(tinker.RateLimitError, match="the most this reefd holds"):
            client.create_lora_training_client(base_model="tiny", rank=2).result()
    finally:
        for service in held:
            service.close("success").result()  # their sessions end: their trainers stop
    client.create_lora_training_client(base_model="tiny", rank=2).result()  # room again


def get(d: Daemon, path: str) -> Any:
    req = urllib.request.Request(d.url + path, headers={"X-API-Key": "tml-" + d.token})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_health_and_capabilities(d: Daemon) -> None:
    """In the SDK's own response types (RestClient's connections outlive it, so the routes are asked directly)."""
    caps = types.GetServerCapabilitiesResponse.model_validate(get(d, "/api/v1/get_server_capabilities"))
    assert [(m.model_name, m.trainable) for m in caps.supported_models] == [("strict", True), ("tiny", True)]
    assert types.HealthResponse.model_validate(get(d, "/api/v1/healthz")).status == "ok"


RL_LOOP = ROOT / "tests" / "tinker" / "rl_loop.py"


def test_a_cookbook_style_rl_loop_samples_through_the_engine_as_records(d: Daemon) -> None:
    out = subprocess.run([sys.executable, str(RL_LOOP)], env={**sdk_env(d), "STEPS": "5"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:] + d.logs()
    steps = [json.loads(line) for line in out.stdout.splitlines()]
    print(json.dumps([round(s["reward"], 3) for s in steps]))
    for receipt in steps[-1]["sequence_ids"]:
        status, raw = d.get(f"/reef/records/{receipt}")
        assert status == 200, raw
        record = json.loads(raw)
        assert record["turn_kind"] == "tinker" and record["scenario"] == "tiny"
        assert len(record["completion_token_ids"]) == len(record["completion_logprobs"]) <= 8
        assert record["adapter"].startswith("tinker-")  # the policy's own weights, loaded beside the served ones
    # a checkpoint a step (save_weights_and_get_sampling_client): those unloaded are deleted, at most 4 stay
    ephemeral = list((d.state / "tinker" / "runs").glob("*/sampler_weights/ephemeral-*"))
    assert 1 <= len(ephemeral) <= 4, ephemeral


def test_a_sampler_samples_the_weights_the_trainer_has(client: tinker.ServiceClient) -> None:
    """The sampler's logprobs of what it sampled are the trainer's own for the same tokens (the engine serves the
    LoRA the trainer saved, on the same base): an importance ratio of 1 where nothing changed in between."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 17, 29, 41]
    result = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    for seq in result.sequences:
        tokens = prompt + seq.tokens
        again = tc.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert again[len(prompt) - 1:] == pytest.approx(seq.logprobs, abs=2e-3), (seq.tokens, again, seq.logprobs)
    base = client.create_sampling_client(base_model="tiny").result()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    assert base.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                       sampling_params=greedy).result().sequences[0].tokens != \
        sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                       sampling_params=greedy).result().sequences[0].tokens


def test_a_checkpoint_the_gate_refuses_is_kept_as_rejected_and_nothing_else_serves(
        d: Daemon, client: tinker.ServiceClient) -> None:
    greedy = []
    for prompt in ("alpha", "beta", "gamma"):
        status, body, _ = d.post("/v1/chat/completions", {"model": "strict", "max_tokens": 6, "temperature": 0,
                                                          "messages": [{"role": "user", "content": prompt}]},
                                 headers={"x-reef-scenario": "strict"})
        assert status == 200, body
        greedy.append({"prompt": prompt, "answer": body["choices"][0]["message"]["content"]})
    (d.scenarios / "tasks-strict.jsonl").write_text("".join(json.dumps(t) + "\n" for t in greedy))
    before = served_by(d, "strict")
    tc = client.create_lora_training_client(base_model="strict", rank=4, seed=5).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    saved = tc.save_weights_for_sampler("try").result()  # what the loop sees: its checkpoint, at once
    assert saved.path.endswith("/sampler_weights/try")
    job = wait_job(d, "strict")
    assert (job["reason"], job["state"]) == ("offered", "rejected"), job
    assert job["verdict"]["verdict"] == "fail" and job["verdict"]["tasks"] == 3, job["verdict"]
    rejected = json.loads(d.get(f"/reef/releases/{job['release']}")[1])
    assert rejected["meta"]["tinker"]["checkpoint"] == saved.path
    assert served_by(d, "strict") == before  # the gate said no: what served before serves on
    sampler = client.create_sampling_client(model_path=saved.path).result()  # the loop may still sample it
    assert sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0)).result().sequences
