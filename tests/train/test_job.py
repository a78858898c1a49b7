"""The trainer job process, `python -m reefd.train --spec FILE`, run for real on the tiny model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from recipes.sao.critic import load_critic
from tests.served import ROOT

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

SAO, GRPO = "recipes.sao.objective:SAOObjective", "recipes.sao.objective:GRPOObjective"
PROMPT = [11, 12, 13, 14]
GOOD, BAD = 100, 200  # the first completion token that earns reward 1, and one that earns 0


@dataclass
class Job:
    returncode: int
    events: list[dict[str, Any]]
    stderr: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def run_job(spec: dict[str, Any], tmp: Path, fault: str | None = None) -> Job:
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps({**spec, **({"fault": {"kind": fault}} if fault else {})}))
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--spec", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is JSON
    return Job(proc.returncode, events, proc.stderr)


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def toy_samples(model: Any, n: int = 8) -> list[dict[str, Any]]:
    """Half the completions start with GOOD (reward 1), half with BAD (reward 0); the rollout
    logprobs are the base model's own, as the engine would have reported them."""
    samples = []
    for i in range(n):
        completion = [GOOD if i % 2 == 0 else BAD, 50 + i, 60 + i]
        samples.append({"receipt": f"r{i}", "prompt_ids": PROMPT, "completion_ids": completion,
                        "logprobs": logprobs(model, PROMPT, completion), "reward": float(i % 2 == 0),
                        "group": "toy"})
    return samples


def make_spec(tiny_model: Path, out: Path, samples: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "job": "j-test", "objective": SAO, "base_model": str(tiny_model), "init_adapter": None,
        "output_dir": str(out), "samples": samples,
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "optim": {"lr": 5e-3, "weight_decay": 0.0, "epochs": 2, "micro_batch": 4, "max_grad_norm": 1.0},
        "settings": {"eps_low": 0.3, "eps_high": 5.0, "critic_lr": 1e-3}, "seed": 0,
    }  # fmt: skip
    spec.update(over)
    return spec


@pytest.fixture(scope="module")
def trained(tiny_model: Path, base: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Path]]:
    """One SAO job from a fresh LoRA, shared by the tests that only read its output."""
    tmp = tmp_path_factory.mktemp("job")
    out = tmp / "out"
    yield run_job(make_spec(tiny_model, out, toy_samples(base)), tmp), out


def peft_logits(tiny_model: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(model, str(adapter)).eval()(input_ids=torch.tensor([PROMPT])).logits[0, -1]


def test_job_writes_a_loadable_adapter(trained: tuple[Job, Path], tiny_model: Path, base: Any) -> None:
    job, out = trained
    assert job.returncode == 0, job.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "critic.safetensors", "metrics.json", "optimizer.pt"]
    with torch.no_grad():
        before = base(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    after = peft_logits(tiny_model, out)
    assert not torch.allclose(before, after, atol=1e-4)  # the trained LoRA changes what the model says
    assert not any(p.name.endswith(".partial") for p in out.parent.iterdir())


def test_progress_lines(trained: tuple[Job, Path]) -> None:
    job, out = trained
    start, progress, done = job.of("start"), job.of("progress"), job.of("done")
    assert [e["event"] for e in job.events] == ["start", *["progress"] * 4, "done"]
    assert start[0]["samples"] == 8 and start[0]["steps"] == 4 and start[0]["trainable_params"] > 0
    assert [e["step"] for e in progress] == [1, 2, 3, 4] and all(e["steps"] == 4 for e in progress)
    assert all(e["tokens_per_s"] > 0 and isinstance(e["loss"], float) for e in progress)
    assert progress[0]["clip_frac"] == 0.0  # rollout logprobs are the base model's own: r = 1 at step 1
    assert done[0]["adapter"] == str(out)
    metrics = done[0]["metrics"]
    assert metrics["mean_reward"] == 0.5 and metrics["steps"] == 4 and 0.0 <= metrics["clip_frac"] <= 1.0
    assert json.loads((out / "metrics.json").read_text())["metrics"] == metrics


@pytest.mark.parametrize("objective", [SAO, GRPO])
def test_a_few_steps_raise_the_rewarded_token(objective: str, tiny_model: Path, base: Any, tmp_path: Path) -> None:
    """Reward 1 for completions that start with GOOD, 0 otherwise: GOOD becomes likelier after PROMPT."""
    samples = toy_samples(base)
    spec = make_spec(tiny_model, tmp_path / "out", samples, objective=objective,
                     optim={"lr": 5e-3, "epochs": 3, "micro_batch": 8})
    job = run_job(spec, tmp_path)
    assert job.returncode == 0, job.stderr
    before = torch.log_softmax(base(input_ids=torch.tensor([PROMPT])).logits[0, -1].detach(), -1)
    after = torch.log_softmax(peft_logits(tiny_model, tmp_path / "out"), -1)
    assert after[GOOD] - before[GOOD] > 0.5
    assert after[BAD] < before[BAD]
    assert (tmp_path / "out" / "critic.safetensors").exists() == (objective == SAO)


def test_continuing_from_an_adapter(trained: tuple[Job, Path], tiny_model: Path, base: Any, tmp_path: Path) -> None:
    """init_adapter: training starts from its weights and its critic, not from a fresh LoRA."""
    _, first = trained
    spec = make_spec(tiny_model, tmp_path / "next", toy_samples(base), init_adapter=str(first),
                     lora={"r": 2, "target_modules": ["q_proj"]},  # ignored when continuing
                     optim={"lr": 1e-7, "epochs": 1, "micro_batch": 4}, settings={"critic_lr": 1e-7})
    job = run_job(spec, tmp_path)
    assert job.returncode == 0, job.stderr
    old = load_file(first / "adapter_model.safetensors")
    new = load_file(tmp_path / "next" / "adapter_model.safetensors")
    assert old.keys() == new.keys()  # r=8 on q/k/v/o, as the init adapter, not the spec's lora block
    lora_b = [k for k in old if "lora_B" in k]
    assert lora_b and all(old[k].abs().max() > 1e-3 for k in lora_b)  # a fresh LoRA has B = 0
    assert all(torch.allclose(old[k], new[k], atol=1e-5) for k in old)  # lr 1e-7: it barely moved from init
    old_critic, old_updates = load_critic(first / "critic.safetensors", 128)
    new_critic, new_updates = load_critic(tmp_path / "next" / "critic.safetensors", 128)
    assert (old_updates, new_updates) == (8, 12)  # 4 steps x K=2, then 2 more steps x K=2
    assert torch.allclose(old_critic.linear.weight, new_critic.linear.weight, atol=1e-5)
    assert old_critic.linear.weight.abs().max() > 1e-4  # the first job's critic learned something


def test_same_spec_same_adapter(trained: tuple[Job, Path], tiny_model: Path, base: Any, tmp_path: Path) -> None:
    job = run_job(make_spec(tiny_model, tmp_path / "again", toy_samples(base)), tmp_path)
    assert job.returncode == 0, job.stderr
    first = load_file(trained[1] / "adapter_model.safetensors")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)


BAD_SPECS = [
    ({"objective": "recipes.sao.objective:PPO"}, "objective: objective 'recipes.sao.objective:PPO' cannot be "
                                                  "imported: module 'recipes.sao.objective' has no attribute 'PPO'"),
    ({"objective": "ppo"}, "objective: 'ppo' is not a dotted path pkg.mod:Class"),
    ({"objective": "recipes.sao.loss:whiten"}, "objective: recipes.sao.loss:whiten is not an Objective (no "),
    ({"samples": []}, "samples: empty"),
    ({"optim": {"lr": -1}}, "optim.lr: -1.0 is not > 0"),
    ({"settings": {"eps_lo": 0.2}}, "settings: unknown key 'eps_lo'"),
    ({"settings": {"eps_low": 0}}, "settings.eps_low: 0.0 is not > 0"),
    ({"objective": GRPO, "samples": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0], "reward": 1}]},
     "samples[0].group: missing (recipes.sao.objective:GRPOObjective needs it)"),
    ({"base_model": "relative/path"}, "base_model: 'relative/path' is not an absolute path"),
    ({"samples": [{"prompt_ids": [1], "completion_ids": [2, 3], "logprobs": [-1.0], "reward": 1}]},
     "samples[0].logprobs: 1 values for 2 completion tokens"),
    ({"samples": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0], "reward": None}]},
     "samples[0].reward: None is not a finite number"),
    ({"samples": [{"prompt_ids": [1], "completion_ids": [99999], "logprobs": [-1.0], "reward": 1}]},
     "token id 99999 is outside the model's vocabulary (4096)"),
    ({"fault": {"kind": "boom"}}, "fault.kind: 'boom' is not one of crash, nan, hang, hold, pause"),
    ({"fault": {"kind": "hold", "hold": ""}}, "fault.hold: expected a non-empty string"),
] # fmt: skip


@pytest.fixture(scope="module")
def refused(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list[dict[str, Any]], Path]]:
    """Every BAD_SPECS spec run by one warm trainer (`--serve`, as reefd runs them; a bad spec fails its job,
    not the process): each job's events, ending with its exit status, and its output folder."""
    tmp = tmp_path_factory.mktemp("bad-specs")
    sample = {"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0], "reward": 1.0, "group": "g"}
    paths, outs = [], []
    for i, (change, _) in enumerate(BAD_SPECS):
        outs.append(tmp / f"out{i}")
        outs[-1].mkdir()
        paths.append(tmp / f"spec-{i}.json")
        paths[-1].write_text(json.dumps({**make_spec(tiny_model, outs[-1], [sample]), **change}))
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--serve"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, input="".join(f"{p}\n" for p in paths))
    assert proc.returncode == 0, proc.stderr
    jobs: list[list[dict[str, Any]]] = [[]]
    for line in proc.stdout.splitlines():
        jobs[-1].append(json.loads(line))
        if jobs[-1][-1]["event"] == "exit":
            jobs.append([])
    assert jobs.pop() == [] and len(jobs) == len(BAD_SPECS), proc.stdout
    return list(zip(jobs, outs, strict=True))


@pytest.mark.parametrize(("index", "reason"), [(i, reason) for i, (_, reason) in enumerate(BAD_SPECS)])
def test_bad_spec(index: int, reason: str, refused: list[tuple[list[dict[str, Any]], Path]]) -> None:
    """Refused with exit status 2 (what `--spec` exits with), one error event naming why, nothing written."""
    events, out = refused[index]
    assert [e["event"] for e in events] == ["error", "exit"] and events[-1]["status"] == 2, events
    assert reason in events[0]["reason"]
    assert list(out.iterdir()) == []


def test_unreadable_spec(tmp_path: Path) -> None:
    (tmp_path / "spec-0.json").write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--spec", str(tmp_path / "spec-0.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and json.loads(proc.stdout)["reason"].startswith("bad spec: spec ")


@pytest.mark.parametrize(("fault", "status", "reason"), [("nan", 3, "non-finite loss at step 1"), ("crash", 137, None)])
def test_faults_leave_nothing(fault: str, status: int, reason: str | None, tiny_model: Path, base: Any,
                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()  # an empty output_dir is allowed, and must still be empty after a failure
    job = run_job(make_spec(tiny_model, out, toy_samples(base, 4)), tmp_path, fault=fault)
    assert job.returncode == status, job.stderr
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "spec-0.json"]  # no partial folder beside it
    if reason is not None:
        assert job.events[-1] == {"event": "error", "reason": reason}
    else:  # crashed right after its first step
        assert [e["event"] for e in job.events] == ["start", "progress"]


def test_sigterm_stops_a_hanging_job(tiny_model: Path, base: Any, tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(json.dumps({**make_spec(tiny_model, tmp_path / "out", toy_samples(base, 2)),
                                                    "fault": {"kind": "hang"}}))
    proc = subprocess.Popen([sys.executable, "-m", "reefd.train", "--spec", str(tmp_path / "spec.json")], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["event"] == "start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert json.loads(proc.stdout.read()) == {"event": "error", "reason": "terminated by SIGTERM"}
    proc.stdout.close()
    assert not (tmp_path / "out").exists()


def test_sigterm_mid_job_saves_the_steps_done(tiny_model: Path, base: Any, tmp_path: Path) -> None:
    """Ray's stop_job (and reefd's cancel or timeout) sends SIGTERM and SIGKILL 3 s later: the trainer stops at once
    and saves the optimizer steps it finished as a complete candidate, marked stopped."""
    hold = tmp_path / "hold"  # the trainer waits after each step while this exists
    hold.touch()
    out = tmp_path / "out"
    (tmp_path / "spec.json").write_text(json.dumps({**make_spec(tiny_model, out, toy_samples(base), seed=3),
                                                    "fault": {"kind": "pause", "hold": str(hold)}}))
    proc = subprocess.Popen([sys.executable, "-m", "reefd.train", "--spec", str(tmp_path / "spec.json")], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["event"] == "start"
    first = json.loads(proc.stdout.readline())
    assert first["event"] == "progress" and first["step"] == 1 and first["steps"] == 4
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    done, error = (json.loads(line) for line in proc.stdout.read().splitlines())
    proc.stdout.close()
    assert done["event"] == "done" and done["metrics"]["stopped"] is True and done["metrics"]["steps"] == 1
    assert error == {"event": "error",
                     "reason": "terminated by SIGTERM after 1 of 4 steps; the steps done are saved"}
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert json.loads((out / "metrics.json").read_text())["metrics"]["stopped"] is True
    assert any(float(t.abs().sum()) > 0 for k, t in saved.items() if "lora_B" in k)  # one step moved B off zero
    assert not list(tmp_path.glob(".out.*.partial"))


def test_spec_in_the_shape_reefd_writes(tiny_model: Path, tmp_path: Path) -> None:
    """reefd's runner names the recipe's objective and its settings, and keeps each sample's report ids; a
    null logprob is accepted (the token then gets no ratio), and a block left out takes its defaults."""
    from reefd.train.spec import SpecError, parse_spec

    sample = {"receipt": "r", "prompt_ids": [1], "completion_ids": [2], "logprobs": [None], "reward": 1,
              "group": "g", "reports": ["rpt_1"]}
    doc = {**make_spec(tiny_model, tmp_path / "out", [sample], objective=GRPO), "seed": 3}
    spec = parse_spec({**doc, "settings": {"eps_low": 0.2, "eps_high": 0.28}})
    assert (spec.objective, spec.seed, spec.settings) == (GRPO, 3, {"eps_low": 0.2, "eps_high": 0.28})
    assert spec.samples[0].logprobs == [None] and spec.samples[0].reward == 1.0
    del doc["settings"], doc["optim"]
    assert parse_spec(doc).settings == {} and parse_spec(doc).optim.micro_batch == 8
    with pytest.raises(SpecError, match=r"settings: expected a JSON object"):
        parse_spec({**doc, "settings": [1]})
    with pytest.raises(SpecError, match=r"spec: unknown key 'algorithm'"):
        parse_spec({**doc, "algorithm": "sao"})


def test_serve_runs_jobs_back_to_back_in_one_process(trained: tuple[Job, Path], tiny_model: Path, base: Any,
                                                      tmp_path: Path) -> None:
    """reefd's local backend: one warm process, one spec path per stdin line, each job ending with an exit event."""
    _, first_out = trained
    specs = []
    for i, change in enumerate(({}, {"objective": "nope"}, {})):
        spec = {**make_spec(tiny_model, tmp_path / f"out{i}", toy_samples(base)), **change}
        path = tmp_path / f"serve-{i}.json"
        path.write_text(json.dumps(spec))
        specs.append(path)
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--serve"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, input="".join(f"{p}\n" for p in specs))
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    exits = [e["status"] for e in events if e["event"] == "exit"]
    assert exits == [0, 2, 0]  # a bad spec fails its job, not the process
    assert [e["event"] for e in events if e["event"] in ("done", "error")] == ["done", "error", "done"]
    first, third = (load_file(str(tmp_path / f"out{i}" / "adapter_model.safetensors")) for i in (0, 2))
    assert all(torch.equal(first[k], third[k]) for k in first)  # the second run starts as clean as the first
    assert all(torch.equal(first[k], v) for k, v in load_file(str(first_out / "adapter_model.safetensors")).items())


def test_the_next_job_continues_the_optimizer_of_the_adapter_it_starts_from(tiny_model: Path, base: Any,
                                                                           tmp_path: Path) -> None:
    """Job 2 starts from job 1's adapter: AdamW goes on (its moments carried) whether job 2 runs in the same warm
    process or in a new one (reefd restarted), which reads the states saved beside the adapter (optimizer.pt): both
    give exactly the same adapter. Without the saved states a new process starts a fresh AdamW, and differs."""
    first = make_spec(tiny_model, tmp_path / "one", toy_samples(base))
    second = {**make_spec(tiny_model, tmp_path / "two", toy_samples(base)), "init_adapter": str(tmp_path / "one")}
    paths = []
    for i, spec in enumerate((first, second)):
        path = tmp_path / f"chain-{i}.json"
        path.write_text(json.dumps(spec))
        paths.append(path)
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--serve"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, input="".join(f"{p}\n" for p in paths))
    assert proc.returncode == 0, proc.stderr
    done = [json.loads(line) for line in proc.stdout.splitlines() if json.loads(line)["event"] == "done"]
    assert [d["metrics"]["optimizer"] for d in done] == ["fresh", "continued"]
    assert (tmp_path / "one" / "optimizer.pt").is_file()
    restarted = run_job({**second, "output_dir": str(tmp_path / "restarted")}, tmp_path)
    assert restarted.returncode == 0 and restarted.of("done")[0]["metrics"]["optimizer"] == "continued"
    warm_w = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    restarted_w = load_file(str(tmp_path / "restarted" / "adapter_model.safetensors"))
    assert all(torch.equal(warm_w[k], restarted_w[k]) for k in warm_w)  # exactly as if run back to back
    (tmp_path / "one" / "optimizer.pt").unlink()
    cold = run_job({**second, "output_dir": str(tmp_path / "cold")}, tmp_path)
    assert cold.returncode == 0 and cold.of("done")[0]["metrics"]["optimizer"] == "fresh"
    cold_w = load_file(str(tmp_path / "cold" / "adapter_model.safetensors"))
    assert any(not torch.equal(warm_w[k], cold_w[k]) for k in warm_w)


def test_a_prewarmed_trainer_has_its_imports_before_the_first_job(tiny_model: Path, base: Any,
                                                                  tmp_path: Path) -> None:
    """reefd starts a trainer when a scenario trains weights; it imports torch before any spec arrives, and the
    first job runs in that very process."""
    import asyncio
    import time

    from reefd.grow.backends.local import LocalTrainers

    def torch_mapped(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    async def main() -> tuple[int, int, list[dict[str, Any]]]:
        trainers = LocalTrainers(tmp_path, 1)
        trainers.prewarm()
        trainers.prewarm()  # a second hint while the first process starts: still one process
        assert trainers._warming is not None
        await trainers._warming
        assert len(trainers._idle) == 1
        pid = trainers._idle[0].pid
        deadline = time.monotonic() + 60
        while not torch_mapped(pid):  # no job sent yet: the imports are the process's own doing
            assert time.monotonic() < deadline, "the idle trainer never imported torch"
            await asyncio.sleep(0.2)
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(make_spec(tiny_model, tmp_path / "out", toy_samples(base))))
        events: list[dict[str, Any]] = []
        status = await trainers.run(path, events.append, 120)
        ran_in = trainers._idle[0].pid
        await trainers.close()
        return pid, ran_in, [*events, {"status": status}]

    pid, ran_in, events = asyncio.run(main())
    assert events[-1] == {"status": 0}
    assert ran_in == pid
    assert [e["event"] for e in events[:-1]][-1] == "done"
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_a_hint_while_a_job_trains_starts_no_second_trainer(tiny_model: Path, base: Any, tmp_path: Path) -> None:
    """A reload (prewarm) while the only trainer runs a job starts nothing: after the job, that process, which
    carries the job's optimizer state, is the one kept warm."""
    import asyncio

    from reefd.grow.backends.local import LocalTrainers

    hold = tmp_path / "hold"
    hold.touch()

    async def main() -> tuple[int, list[int], list[int]]:
        trainers = LocalTrainers(tmp_path, 1)
        spawned: list[int] = []
        spawn = trainers._spawn

        async def counting() -> Any:
            proc = await spawn()
            spawned.append(proc.pid)
            return proc

        trainers._spawn = counting  # type: ignore[method-assign]
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({**make_spec(tiny_model, tmp_path / "out", toy_samples(base)),
                                    "fault": {"kind": "hold", "hold": str(hold)}}))
        events: list[dict[str, Any]] = []
        job = asyncio.create_task(trainers.run(path, events.append, 120))
        while not any(e.get("event") == "start" for e in events):
            await asyncio.sleep(0.05)
        trainers.prewarm()
        if trainers._warming is not None:
            await trainers._warming
        hold.unlink()
        status = await job
        kept = [p.pid for p in trainers._idle]
        await trainers.close()
        return status, spawned, kept

    status, spawned, kept = asyncio.run(main())
    assert status == 0
    assert len(spawned) == 1 and kept == spawned


def test_full_target_trains_every_parameter_into_a_full_model_folder(tiny_model: Path, base: Any,
                                                                    tmp_path: Path) -> None:
    """`target: full`: no adapter; the job writes an HF model folder the base's engine can load as new weights
    (reefd's own check passes), and the rewarded token becomes likelier under it."""
    from transformers import AutoModelForCausalLM

    from reefd.commit.weights import check_weights

    spec = make_spec(tiny_model, tmp_path / "out", toy_samples(base), target="full",
                     optim={"lr": 1e-3, "epochs": 3, "micro_batch": 8})
    job = run_job(spec, tmp_path)
    assert job.returncode == 0, job.stderr
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "objective"} <= names
    assert "adapter_config.json" not in names and not list(out.glob("critic*"))
    assert (out / "objective" / "critic.safetensors").is_file()  # the objective's state, apart from the weights
    total = sum(p.numel() for p in base.parameters())
    assert job.of("start")[0]["trainable_params"] == total
    assert check_weights(out, tiny_model) == []
    trained = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        before = torch.log_softmax(base(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
        after = torch.log_softmax(trained(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
    assert after[GOOD] - before[GOOD] > 0.5


def test_full_target_starts_from_the_serving_adapter_merged(trained: tuple[Job, Path], tiny_model: Path, base: Any,
                                                            tmp_path: Path) -> None:
    """A full job on a release that serves an adapter starts from what serves: the adapter folded into the weights
    (checked with lr 0: the written weights answer as base + adapter does)."""
    from transformers import AutoModelForCausalLM

    _, adapter = trained
    spec = make_spec(tiny_model, tmp_path / "out", toy_samples(base), target="full", init_adapter=str(adapter),
                     optim={"lr": 1e-12, "epochs": 1, "micro_batch": 8})
    job = run_job(spec, tmp_path)
    assert job.returncode == 0, job.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        got = merged.eval()(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert torch.allclose(got, peft_logits(tiny_model, adapter), atol=1e-3)


def test_an_unknown_target_is_a_bad_spec(tiny_model: Path, base: Any, tmp_path: Path) -> None:
    job = run_job(make_spec(tiny_model, tmp_path / "out", toy_samples(base), target="half"), tmp_path)
    assert job.returncode == 2 and "target: 'half' is not one of lora, full" in job.of("error")[0]["reason"]
