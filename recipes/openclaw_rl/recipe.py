"""OpenClaw-RL as a Reef recipe: judged turns in the records -> a LoRA trainer job. No reports needed.

The daemon side (no torch). A turn is a sample once reefd's judge has judged it from its next state (a report with
`source: judge`): a ±1 verdict trains the RL term, a hint (with a full top-K capture) trains the distillation term.
Reports that clients send are kept but do not train. The loss runs in the trainer process, as the objective the
job names (recipes/openclaw_rl/objective.py); recipes/openclaw_rl/README.md explains every parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reefd.grow.recipes import JudgeSettings, RecipeError, Sample, WeightJob, check_model_or_function, engine_tokens
from reefd.grow.staleness import StalenessParams

if TYPE_CHECKING:
    from reefd.harness import Harness


@dataclass
class JudgeParams:
    """The judge (process reward model): who judges, and how many votes."""

    model: Any = field(default=None, metadata={
        "description": "null: the scenario's own engine (its base model); a model config (engine, source/path/url, "
                       "...); or a Python function pkg.mod:fn that answers a JudgeCall (tests and scripted demos)."})
    votes: int = field(default=3, metadata={"minimum": 1, "description": "Votes per question (m)."})
    temperature: float = field(default=0.6, metadata={"minimum": 0, "maximum": 2})
    top_p: float = field(default=1.0, metadata={"exclusiveMinimum": 0, "maximum": 1})
    max_tokens: int = field(default=512, metadata={"minimum": 1, "description": "Per vote."})
    timeout_s: float = field(default=120.0, metadata={"exclusiveMinimum": 0, "description": "Per vote."})
    hints: bool = field(default=True, metadata={"description": "Ask for hindsight hints (the OPD term's teacher)."})
    max_hints: int = field(default=3, metadata={"minimum": 1})
    concurrency: int = field(default=2, metadata={"minimum": 1, "description": "Turns judged at once."})


@dataclass
class OpenClawConfig(StalenessParams):
    """OpenClaw-RL's settings (see recipes/openclaw_rl/README.md for where each default comes from)."""

    batch_size: int = field(default=16, metadata={"minimum": 1, "description": "Judged turns per job (one step)."})
    lr: float = field(default=1e-4, metadata={"exclusiveMinimum": 0, "description": "AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"minimum": 0})
    max_grad_norm: float = field(default=1.0, metadata={"exclusiveMinimum": 0})
    lora_r: int = field(default=32, metadata={"minimum": 1, "description": "LoRA rank of a fresh adapter."})
    lora_alpha: int = field(default=64, metadata={"minimum": 1})
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    w_rl: float = field(default=1.0, metadata={"minimum": 0, "description": "Weight of the PPO-clip term."})
    w_opd: float = field(default=1.0, metadata={"minimum": 0, "description": "Weight of the distillation term."})
    eps: float = field(default=0.2, metadata={"exclusiveMinimum": 0, "maximum": 1})
    eps_high: float = field(default=0.28, metadata={"exclusiveMinimum": 0})
    diff_clip: float = field(default=1.0, metadata={"exclusiveMinimum": 0,
                                                    "description": "Bound on teacher - old log-prob per token."})
    top_k: int = field(default=4, metadata={"minimum": 1, "maximum": 20,
                                            "description": "Top-K logprobs captured per generated token."})
    opd_set: str = field(default="engine", metadata={
        "enum": ["engine", "union"],
        "description": "The tokens distillation scores at each position: the engine's top-K (the paper's), or "
                       "their union with the hinted teacher's own top-K (a token the policy ranks below its "
                       "top-K can then be taught)."})
    judge: JudgeParams = field(default_factory=JudgeParams)
    seed: int = 0


class OpenClawRL:
    """Each judged turn stands alone: its verdict is the advantage of every response token (RL), and its hint
    makes the frozen base a teacher over the engine's top-K tokens (OPD)."""

    Config = OpenClawConfig
    produces = "weights"
    objective = "recipes.openclaw_rl.objective:OpenClawObjective"

    def __init__(self, cfg: OpenClawConfig) -> None:
        if cfg.w_rl == 0 and cfg.w_opd == 0:
            raise RecipeError("recipe.params: w_rl and w_opd are both 0, so nothing would train")
        self.cfg = cfg
        self.staleness = cfg.policy()  # its objective weights stale turns (README: stale turns)
        self.capture_top_k = cfg.top_k
        j = cfg.judge
        check_model_or_function(j.model, "recipe.params.judge.model", "judge")
        self.judge = JudgeSettings(model=j.model, votes=j.votes, temperature=j.temperature, top_p=j.top_p,
                                   max_tokens=j.max_tokens, timeout_s=j.timeout_s,
                                   hints=j.hints and cfg.w_opd > 0, max_hints=j.max_hints,
                                   concurrency=j.concurrency)

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return judged_turn(record, reports, self.cfg)

    def ready(self, samples: list[Sample]) -> bool:
        return len(samples) >= self.cfg.batch_size

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        c = self.cfg
        batch = samples[: c.batch_size]
        return WeightJob(
            objective=self.objective, samples=batch,
            lora={"r": c.lora_r, "alpha": c.lora_alpha, "dropout": 0.0, "target_modules": list(c.target_modules)},
            optim={"lr": c.lr, "weight_decay": c.weight_decay, "epochs": 1, "micro_batch": len(batch),
                   "max_grad_norm": c.max_grad_norm},  # the whole batch in one step
            settings={"w_rl": c.w_rl, "w_opd": c.w_opd, "eps": c.eps, "eps_high": c.eps_high,
                      "diff_clip": c.diff_clip, "opd_set": c.opd_set, "stale_clip": c.stale_clip},
            seed=c.seed)


def judgment(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The judge's latest report on a turn (client reports never count here)."""
    judged = [r for r in reports if r.get("source") == "judge" and isinstance(r.get("metadata"), dict)]
    return judged[-1] if judged else None


def top_rows(record: dict[str, Any], tokens: int, k: int) -> list[list[int]] | None:
    """The record's top-K ids as K per token, or None when the capture is not full (or of another K)."""
    flat = record.get("completion_top_ids")
    if record.get("top_k_capture") != "full" or record.get("top_k") != k or not isinstance(flat, list):
        return None
    if len(flat) != k * tokens:
        return None
    return [flat[i * k:(i + 1) * k] for i in range(tokens)]


def judged_turn(record: dict[str, Any], reports: list[dict[str, Any]], cfg: OpenClawConfig) -> Sample | None:
    """A conversation turn with a next state and a judgment that gives it something to learn: RL (a ±1 verdict,
    w_rl > 0) or OPD (a hint, a full top-K capture, w_opd > 0). Side calls, retries nobody continued and final
    turns have no next state, so they never qualify."""
    if record.get("turn_kind") not in ("main", "retry") or not record.get("next_state"):
        return None
    tokens = engine_tokens(record)
    if tokens is None:
        return None
    prompt, ids, logprobs = tokens
    report = judgment(reports)
    if report is None:
        return None
    meta = report["metadata"]
    verdict = meta.get("verdict")
    verdict = verdict if verdict in (1, -1, 0) else 0
    hints = [h for h in meta.get("hints") or [] if isinstance(h, str) and h]
    top = top_rows(record, len(ids), cfg.top_k)
    rl = cfg.w_rl > 0 and verdict != 0
    opd = cfg.w_opd > 0 and bool(hints) and top is not None
    if not (rl or opd):
        return None
    messages = list(record.get("messages") or [])[:-1]  # the prompt as served (the reply is the last message)
    return Sample(receipt=record["id"], prompt_ids=list(prompt), completion_ids=list(ids),
                  logprobs=[None if lp is None or not math.isfinite(lp) else lp for lp in logprobs],
                  reward=float(verdict) if rl else 0.0, group=record["id"], reports=[report["report_id"]],
                  top_ids=top if opd else None,
                  extra={"rl": rl, "opd": opd, "hints": hints if opd else [], "messages": messages if opd else [],
                         "tools": list(record.get("tools") or []) if opd else []},
                  context={"verdict": verdict, "session": record.get("session"), "turn": record.get("turn")})
