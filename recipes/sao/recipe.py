"""SAO and its GRPO control as Reef recipes: scored rollouts in the records -> a LoRA trainer job.

This is the daemon side (no torch): which records count, when a batch is ready, and the trainer
spec. The loss and the critic run in the trainer process, as the objective the spec names
(recipes/sao/objective.py); the parameters are explained in recipes/sao/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reefd.grow.recipes import Sample, WeightJob, scored_rollout
from reefd.grow.staleness import StalenessParams

if TYPE_CHECKING:
    from reefd.harness import Harness


@dataclass
class SAOConfig(StalenessParams):
    """SAO's settings (see recipes/sao/README.md for where each default comes from)."""

    batch_size: int = field(default=8, metadata={"minimum": 1,
                                                 "description": "Scored rollouts per optimizer job."})
    lr: float = field(default=5e-4, metadata={"exclusiveMinimum": 0, "description": "AdamW learning rate."})
    epochs: int = field(default=1, metadata={"minimum": 1, "description": "Passes over the batch."})
    micro_batch: int = field(default=8, metadata={"minimum": 1, "description": "Rollouts per forward pass."})
    max_grad_norm: float = field(default=1.0, metadata={"exclusiveMinimum": 0})
    weight_decay: float = field(default=0.0, metadata={"minimum": 0})
    lora_r: int = field(default=8, metadata={"minimum": 1, "description": "LoRA rank of a fresh adapter."})
    lora_alpha: int = field(default=16, metadata={"minimum": 1})
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    eps_low: float = field(default=0.3, metadata={"exclusiveMinimum": 0, "maximum": 1,
                                                  "description": "Lower edge of the ratio band: 1 - eps_low."})
    eps_high: float = field(default=5.0, metadata={"exclusiveMinimum": 0,
                                                    "description": "Upper edge of the ratio band: 1 + eps_high."})
    critic_lr: float = field(default=1e-3, metadata={"exclusiveMinimum": 0,
                                                     "description": "Learning rate of the value head."})
    gae_alpha: float = field(default=1.5, metadata={
        "exclusiveMinimum": 0, "description": "Length-adaptive GAE: lambda = 1 - 1 / (gae_alpha * length)."})
    normalize_advantages: bool = field(default=False, metadata={
        "description": "Whiten the advantages of each micro-batch (off in the paper's recipe)."})
    target: str = field(default="lora", metadata={"enum": ["lora", "full"],
                                                  "description": "lora: train a LoRA adapter; full: train every "
                                                                 "parameter and publish full weights."})
    seed: int = 0


class SAO:
    """Single-rollout: each scored rollout stands alone, its advantage from the critic (reward - V)."""

    Config = SAOConfig
    produces = "weights"
    objective = "recipes.sao.objective:SAOObjective"

    def __init__(self, cfg: SAOConfig) -> None:
        self.cfg = cfg
        self.staleness = cfg.policy()  # its objective weights stale samples (README: stale samples)

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        return scored_rollout(record, reports)

    def ready(self, samples: list[Sample]) -> bool:
        return len(samples) >= self.cfg.batch_size

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        c = self.cfg
        return WeightJob(
            objective=self.objective, samples=samples[: c.batch_size],
            lora={"r": c.lora_r, "alpha": c.lora_alpha, "dropout": 0.0, "target_modules": list(c.target_modules)},
            optim={"lr": c.lr, "weight_decay": c.weight_decay, "epochs": c.epochs, "micro_batch": c.micro_batch,
                   "max_grad_norm": c.max_grad_norm},
            settings={"eps_low": c.eps_low, "eps_high": c.eps_high, "critic_lr": c.critic_lr,
                      "gae_alpha": c.gae_alpha, "normalize_advantages": c.normalize_advantages,
                      "stale_clip": c.stale_clip}, seed=c.seed,
            target=c.target)


class GRPO(SAO):
    """The control: the same ratio primitive and band, advantages relative to the rollouts of the same prompt."""

    objective = "recipes.sao.objective:GRPOObjective"
