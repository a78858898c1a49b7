"""Learning checks (issue 44, point 5): each weight recipe, from fixed seeds on the tiny model, must move its
held-out metric the right way within a few steps, and the same check fails when its objective's sign is flipped or
its gradient dropped. Steps are counted, never time.

The task: after each of 16 questions, the answer " yes" is scored 1 and " no" is scored 0 (OpenClaw-RL: the
judge's +1 and -1). Records are shaped as reefd keeps them (engine token ids and logprobs, reports), go through the
recipe's own `sample` and `candidate`, and the job's spec through the trainer's own `train`, as a job would. The
held-out metric is the mean of log p(" yes") - log p(" no") on 8 other questions: it must rise by MARGIN nats
from the base within STEPS optimizer steps. A flipped objective must lower it, a dropped gradient leave it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from recipes.openclaw_rl.objective import OpenClawObjective, with_hint
from recipes.openclaw_rl.recipe import JudgeParams, OpenClawConfig, OpenClawRL
from recipes.sao.objective import GRPOObjective, SAOObjective
from recipes.sao.recipe import GRPO, SAO, SAOConfig
from recipes.ttt_discover.objective import TTTObjective
from recipes.ttt_discover.recipe import TTTConfig, TTTDiscover
from reefd.grow.recipes import Sample, WeightJob
from reefd.serve.chat import ChatRequest, ChatTemplate
from reefd.train.batch import collate
from reefd.train.spec import Rollout, load_spec
from reefd.train.training import Policy, train

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

WORDS = ["apple", "stone", "river", "cloud", "paper", "glass", "tiger", "candle", "orbit", "meadow", "silver",
         "lantern", "pepper", "harbor", "violin", "marble", "window", "forest", "copper", "thunder", "garden",
         "pillow", "saddle", "comet"]
TRAIN = [f"Question {i}: is {w} a word?" for i, w in enumerate(WORDS[:16])]
HELD_OUT = [f"Question {i}: is {w} a word?" for i, w in enumerate(WORDS[16:], start=100)]
STEPS = 6  # optimizer steps each recipe gets
MARGIN = 0.5  # nats the held-out metric must rise by within them
OPD_SHARE = 0.85  # the held-out KL to the hinted teacher must fall to this share of the base's within them


@dataclasses.dataclass
class Task:
    tiny: Path
    prompts: list[list[int]]
    held_out: list[list[int]]
    yes: list[int]
    no: list[int]


@pytest.fixture(scope="module")
def task(tiny_model: Path) -> Task:
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    ids = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
    return Task(tiny_model, [ids(q) for q in TRAIN], [ids(q) for q in HELD_OUT], ids(" yes"), ids(" no"))


def records(task: Task, scores: tuple[float, float] = (1.0, 0.0), each: int = 1
            ) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """Each training question answered " yes" and " no" (`each` times), with the base model's own logprobs (as
    the engine recorded them) and a report scoring each answer."""
    base = Policy(_spec(task, [], None, task.tiny.parent / "learning-base"))
    for i, prompt in enumerate(task.prompts):
        for n, (answer, score) in enumerate(zip((task.yes, task.no) * each, scores * each, strict=True)):
            rollout = Rollout(prompt, answer, [0.0] * len(answer), score)
            with torch.no_grad():
                logprobs = base.reference(collate([rollout], [0], base.pad_id)).logp[0, : len(answer)].tolist()
            rid = f"r{i}-{n}"
            yield ({"id": rid, "prompt_token_ids": prompt, "completion_token_ids": answer,
                    "completion_logprobs": logprobs, "turn_kind": "main", "next_state": [{"role": "user"}]},
                   [{"report_id": f"p-{rid}", "score": score, "source": "client"}])


def _spec(task: Task, samples: list[Sample], job: WeightJob | None, out: Path) -> Any:
    """The trainer spec a job of `job` writes (reefd/grow/job_kinds/weight_job.py), on the tiny model."""
    doc = {"job": "learning", "objective": job.objective if job else "x:Y", "settings": job.settings if job else {},
           "seed": 0, "base_model": str(task.tiny), "init_adapter": None, "output_dir": str(out),
           "lora": job.lora if job else {}, "optim": job.optim if job else {}, "target": "lora",
           "samples": [{k: v for k, v in dataclasses.asdict(s).items() if k != "context"} for s in samples]
           or [{"prompt_ids": [1], "completion_ids": [1], "logprobs": [0.0], "reward": 0.0}]}
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(doc))
    return load_spec(path)


def held_out(policy: Policy, task: Task, base: bool = False) -> float:
    """Mean log p(" yes") - log p(" no") after each held-out question (the base model's with `base`)."""
    rows = [Rollout(p, answer, [0.0] * len(answer), 0.0) for p in task.held_out for answer in (task.yes, task.no)]
    batch = collate(rows, list(range(len(rows))), policy.pad_id)
    with torch.no_grad():
        logp = (policy.reference(batch) if base else policy.forward(batch)).logp
    sums = (logp * batch.tokens).sum(-1)
    return float((sums[0::2] - sums[1::2]).mean())


def learn(recipe: Any, task: Task, tmp: Path, samples: list[Sample]) -> tuple[float, float]:
    """(base, after STEPS steps) of the held-out metric for the recipe's job on `samples`."""
    job = recipe.candidate(samples)
    job.optim = {**job.optim, "epochs": STEPS, "micro_batch": len(job.samples)}  # STEPS steps, each on the batch
    spec = _spec(task, job.samples, job, tmp / "out")
    trained = train(spec, lambda event: None)
    return held_out(trained.policy, task, base=True), held_out(trained.policy, task)


def sao(task: Task, grpo: bool = False) -> tuple[Any, list[Sample]]:
    recipe = (GRPO if grpo else SAO)(SAOConfig(batch_size=32, lr=3e-3, micro_batch=32))
    return recipe, [s for r, reports in records(task) if (s := recipe.sample(r, reports)) is not None]


def openclaw(task: Task) -> tuple[Any, list[Sample]]:
    judge = JudgeParams(model="tests.recipes.judges:scripted")
    recipe = OpenClawRL(OpenClawConfig(batch_size=32, lr=3e-3, w_opd=0.0, judge=judge))  # the RL term (OPD: below)
    out = []
    for record, reports in records(task, scores=(1.0, -1.0)):
        judged = {"report_id": f"j-{record['id']}", "source": "judge",
                  "metadata": {"verdict": int(reports[0]["score"]), "hints": []}}
        sample = recipe.sample(record, [judged])
        assert sample is not None
        out.append(sample)
    return recipe, out


def ttt(task: Task) -> tuple[Any, list[Sample]]:
    recipe = TTTDiscover(TTTConfig(groups=len(task.prompts), rollouts=4, lr=3e-3))  # a group: one question's
    out = []
    for n, (record, reports) in enumerate(records(task, each=2)):
        coordinate = {**reports[0], "metadata": {"step": 0, "group": n // 4, "rollout": n % 4}}
        sample = recipe.sample(record, [coordinate])
        assert sample is not None
        out.append(sample)
    return recipe, out


RECIPES: dict[str, tuple[Callable[[Task], tuple[Any, list[Sample]]], Any]] = {
    "sao": (sao, SAOObjective), "grpo": (lambda t: sao(t, grpo=True), GRPOObjective),
    "openclaw-rl": (openclaw, OpenClawObjective), "ttt-discover": (ttt, TTTObjective)}


HINT = "Answer yes." + " yes" * 40  # long enough to move the tiny (random) model's next token


def chat_prompt(task: Task, question: str, hint: str | None = None) -> list[int]:
    template = ChatTemplate(task.tiny)
    messages = [{"role": "user", "content": question}]
    return template.prompt_ids(ChatRequest(messages=with_hint(messages, hint) if hint else messages, max_tokens=1))


def next_token(policy: Policy, prompts: list[list[int]], base: bool = True) -> torch.Tensor:
    """[N, V] log-probs of the token after each prompt (the base model's with `base`, else the policy's)."""
    rows = []
    with torch.no_grad(), (policy.model.disable_adapter() if base else contextlib.nullcontext()):
        for prompt in prompts:
            rows.append(policy.causal_lm(input_ids=torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1))
    return torch.stack(rows)


def opd_gap(policy: Policy, task: Task, base: bool = False) -> float:
    """Held-out: mean KL(hinted teacher || policy) at the answer's first token (the base's with `base`)."""
    teacher = next_token(policy, [chat_prompt(task, q, HINT) for q in HELD_OUT])
    student = next_token(policy, [chat_prompt(task, q) for q in HELD_OUT], base=base)
    return float((teacher.exp() * (teacher - student)).sum(-1).mean())


def opd(task: Task) -> tuple[Any, list[Sample]]:
    """OpenClaw-RL's distillation term alone: each question's answer is the base's own first token, its top-4
    the engine's capture, and the judge's hint makes the frozen base the teacher."""
    judge = JudgeParams(model="tests.recipes.judges:scripted")
    recipe = OpenClawRL(OpenClawConfig(batch_size=16, lr=3e-3, w_rl=0.0, opd_set="union", top_k=4, judge=judge))
    base = Policy(_spec(task, [], None, task.tiny.parent / "learning-opd-base"))
    out = []
    for i, question in enumerate(TRAIN):
        prompt = chat_prompt(task, question)
        logp = next_token(base, [prompt])[0]
        top = logp.topk(4).indices.tolist()
        record = {"id": f"o{i}", "prompt_token_ids": prompt, "completion_token_ids": top[:1],
                  "completion_logprobs": [float(logp[top[0]])], "turn_kind": "main", "top_k": 4,
                  "top_k_capture": "full", "completion_top_ids": top, "next_state": [{"role": "user"}],
                  "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "?"}]}
        judged = {"report_id": f"j{i}", "source": "judge", "metadata": {"verdict": 0, "hints": [HINT]}}
        sample = recipe.sample(record, [judged])
        assert sample is not None and (sample.extra or {}).get("opd")
        out.append(sample)
    return recipe, out


def flipped(loss: Callable[..., Any]) -> Callable[..., Any]:
    def negated(self: Any, batch: Any, out: Any) -> Any:
        total, stats = loss(self, batch, out)
        return -total, stats
    return negated


def dropped(loss: Callable[..., Any]) -> Callable[..., Any]:
    def detached(self: Any, batch: Any, out: Any) -> Any:
        total, stats = loss(self, batch, out)
        return total.detach() + 0.0 * out.logp.sum(), stats
    return detached


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_moves_its_held_out_metric_within_a_few_steps(name: str, task: Task, tmp_path: Path) -> None:
    recipe, samples = RECIPES[name][0](task)
    base, after = learn(recipe, task, tmp_path, samples)
    print(f"learning check {name}: held-out log p(yes) - log p(no) {base:.3f} -> {after:.3f} in {STEPS} steps")
    assert after - base >= MARGIN, (name, base, after)


@pytest.mark.parametrize("fault", [None, flipped, dropped], ids=["as-shipped", "sign-flipped", "gradient-dropped"])
def test_openclaws_distillation_moves_the_policy_toward_the_hinted_teacher(
        fault: Callable[..., Any] | None, task: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if fault is not None:
        monkeypatch.setattr(OpenClawObjective, "loss", fault(OpenClawObjective.loss))
    recipe, samples = opd(task)
    job = recipe.candidate(samples)
    job.optim = {**job.optim, "epochs": STEPS}
    trained = train(_spec(task, job.samples, job, tmp_path / "out"), lambda event: None)
    base, after = opd_gap(trained.policy, task, base=True), opd_gap(trained.policy, task)
    print(f"learning check openclaw-rl (distillation), {fault.__name__ if fault else 'as shipped'}: held-out "
          f"KL(teacher || policy) {base:.4f} -> {after:.4f}")
    assert (after <= OPD_SHARE * base) == (fault is None), (base, after)


@pytest.mark.parametrize("fault", [flipped, dropped], ids=["sign-flipped", "gradient-dropped"])
@pytest.mark.parametrize("name", RECIPES)
def test_the_check_fails_when_the_objective_is_broken(name: str, fault: Callable[..., Any], task: Task,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, objective = RECIPES[name]
    monkeypatch.setattr(objective, "loss", fault(objective.loss))
    recipe, samples = make(task)
    base, after = learn(recipe, task, tmp_path, samples)
    print(f"learning check {name}, {fault.__name__}: {base:.3f} -> {after:.3f}")
    assert after - base < MARGIN, (name, fault.__name__, base, after)
