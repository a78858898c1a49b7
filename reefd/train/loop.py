"""The training loop: base model + PEFT LoRA on CPU float32, per-token log-probs of each completion,
the algorithm's loss (recipes.sao), AdamW with grad-norm clipping, then the adapter and critic files.

Imports torch; runs only in the trainer process. Reports through an `emit` callback and raises;
it knows nothing about JSON lines, exit codes or where the candidate folder finally lands.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipes.sao import CRITIC_FILE
from recipes.sao.critic import ValueHead, critic_update, explained_variance, load_critic, save_critic
from recipes.sao.loss import gae_advantages, group_advantages, length_adaptive_lambda, policy_loss, whiten
from reefd.train import NonFinite
from reefd.train.spec import Sample, SpecError, TrainSpec

Emit = Callable[[dict[str, Any]], None]
# Heads that are not a plain `lm_head(h)`: use the model's own forward for their logits.
_SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class Batch:
    """One right-padded micro-batch; [B, T] tensors are completion-aligned (column t = token t)."""

    input_ids: Tensor  # [B, L] prompt + completion, right padded
    attention_mask: Tensor  # [B, L]
    positions: Tensor  # [B, T] the input position whose output predicts completion token t
    completion: Tensor  # [B, T]
    rollout_logp: Tensor  # [B, T] the engine's logprob (0 where null)
    tokens: Tensor  # [B, T] bool: a completion token (not padding)
    valid: Tensor  # [B, T] bool: a completion token with a rollout logprob
    lengths: Tensor  # [B] completion lengths
    rewards: Tensor  # [B]
    n_tokens: int  # prompt + completion tokens, padding excluded


def collate(samples: list[Sample], pad_id: int) -> Batch:
    rows = [s.prompt_ids + s.completion_ids for s in samples]
    width, depth = max(len(r) for r in rows), max(len(s.completion_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, depth), dtype=torch.long)
    completion = torch.zeros((n, depth), dtype=torch.long)
    rollout = torch.zeros((n, depth), dtype=torch.float32)
    tokens = torch.zeros((n, depth), dtype=torch.bool)
    valid = torch.zeros((n, depth), dtype=torch.bool)
    for i, (s, row) in enumerate(zip(samples, rows, strict=True)):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        positions[i, :c] = torch.arange(p - 1, p - 1 + c)
        completion[i, :c] = torch.tensor(s.completion_ids)
        tokens[i, :c] = True
        for j, lp in enumerate(s.logprobs):
            if lp is not None:
                rollout[i, j], valid[i, j] = lp, True
    return Batch(input_ids, attention, positions, completion, rollout, tokens, valid,
                 lengths=torch.tensor([len(s.completion_ids) for s in samples]),
                 rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                 n_tokens=sum(len(r) for r in rows))


class Policy:
    """The base model with its LoRA (fresh from spec.lora, or continued from init_adapter)."""

    def __init__(self, spec: TrainSpec) -> None:
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        base: Any = AutoModelForCausalLM.from_pretrained(
            spec.base_model, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
        ).float()
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            if spec.init_adapter is not None:
                self.model: Any = PeftModel.from_pretrained(base, str(spec.init_adapter), is_trainable=True)
            else:
                lora = spec.lora
                config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                    target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
                self.model = get_peft_model(base, config)
        self.model.train()
        self.causal_lm: Any = self.model.get_base_model()
        self.config = self.causal_lm.config
        self.plain_head = not any(getattr(self.config, k, None) for k in _SCALED_LOGITS)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.causal_lm.get_input_embeddings().weight.shape[0])
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the adapter has no trainable parameters")

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Log-probs [B, T] of the completion tokens, and the hidden states [B, T, H] that predict them."""
        index = batch.positions.unsqueeze(-1)
        if self.plain_head:  # the LM head only where a completion token is predicted
            out = self.causal_lm.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                               use_cache=False)
            hidden = out.last_hidden_state.gather(1, index.expand(-1, -1, self.hidden_size))
            logits = self.causal_lm.get_output_embeddings()(hidden).float()
        else:
            out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                             output_hidden_states=True)
            hidden = out.hidden_states[-1].gather(1, index.expand(-1, -1, self.hidden_size))
            logits = out.logits.float().gather(1, index.expand(-1, -1, out.logits.shape[-1]))
        picked = logits.gather(-1, batch.completion.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1), hidden


# Optimizer state carries over from job to job in a warm trainer (`--serve`): it is kept under the sha256 of the
# adapter a job wrote, and found again when a later job starts from that adapter (the release now serving). So a
# scenario's LoRA is trained by one AdamW across jobs, as one long run would be, instead of every job taking
# Adam's first, sign-like step again. A cold process, or a job starting from another adapter, starts fresh.
_CARRIED: OrderedDict[str, dict[str, Any]] = OrderedDict()
_CARRY_MAX = 4


def _adapter_key(folder: Path) -> str | None:
    weights = folder / "adapter_model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None


@dataclass
class Result:
    """What a finished job hands over: the trained model, the critic (sao), optimizer states and the metrics."""

    policy: Policy
    critic: ValueHead | None
    critic_updates: int
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            self.policy.model.save_pretrained(str(folder), safe_serialization=True)
        (folder / "README.md").unlink(missing_ok=True)  # peft's model-card stub, not part of a candidate
        if self.critic is not None:
            save_critic(self.critic, folder / CRITIC_FILE, self.critic_updates)
        key = _adapter_key(folder)
        if key is not None and self.optimizers:
            _CARRIED[key] = self.optimizers
            while len(_CARRIED) > _CARRY_MAX:
                _CARRIED.popitem(last=False)


def train(spec: TrainSpec, emit: Emit, fault: str | None = None) -> Result:
    """Run every step of the job; emits start and progress, raises NonFinite/SpecError/others."""
    torch.manual_seed(spec.seed)
    run = Run(spec)
    emit({"event": "start", "samples": len(spec.samples), "steps": spec.steps,
          "trainable_params": sum(p.numel() for p in run.policy.params)})
    if fault == "hang":
        while True:
            time.sleep(3600)
    hold = Path(os.environ.get("REEF_TRAIN_HOLD") or "/nonexistent") if fault == "hold" else None
    while hold is not None and hold.exists():  # the tests keep a job in its train stage while this file exists
        time.sleep(0.05)
    gen = torch.Generator().manual_seed(spec.seed)
    step, started = 0, time.perf_counter()
    for _ in range(spec.optim.epochs):
        order = torch.randperm(len(spec.samples), generator=gen).tolist()
        for lo in range(0, len(order), spec.optim.micro_batch):
            step += 1
            line = run.step(step, order[lo : lo + spec.optim.micro_batch], poison=fault == "nan" and step == 1)
            emit({"event": "progress", "step": step, "steps": spec.steps, **line})
            if fault == "crash":
                os._exit(137)
    metrics = {**run.totals.summary(spec, time.perf_counter() - started), "optimizer": run.optimizer_origin}
    states = {"policy": run.opt.state_dict()}
    if run.critic_opt is not None:
        states["critic"] = run.critic_opt.state_dict()
    return Result(run.policy, run.critic, run.critic_updates, metrics, states)


class Run:
    """One job's state: the policy and its optimizer, the critic (sao) or the group advantages (grpo)."""

    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.policy = Policy(spec)
        too_big = max(max(s.prompt_ids + s.completion_ids) for s in spec.samples)
        if too_big >= self.policy.vocab_size:
            raise SpecError(f"samples: token id {too_big} is outside the model's vocabulary ({self.policy.vocab_size})")
        self.opt = torch.optim.AdamW(self.policy.params, lr=spec.optim.lr, weight_decay=spec.optim.weight_decay)
        self.critic, self.critic_opt, self.critic_updates = _critic(spec, self.policy)
        self.optimizer_origin = self._continue_optimizers()
        self.group_adv = None
        if spec.algorithm == "grpo":
            self.group_adv = group_advantages([s.reward for s in spec.samples], [str(s.group) for s in spec.samples],
                                              spec.sao.grpo_eps)
        self.totals = _Totals()

    def _continue_optimizers(self) -> str:
        """"continued" when this process trained the adapter the job starts from (its AdamW state goes on),
        else "fresh". This job's own lr and weight decay apply either way."""
        key = _adapter_key(self.spec.init_adapter) if self.spec.init_adapter is not None else None
        carried = _CARRIED.get(key) if key is not None else None
        if carried is None:
            return "fresh"
        try:
            self.opt.load_state_dict(carried["policy"])
            if self.critic_opt is not None and "critic" in carried:
                self.critic_opt.load_state_dict(carried["critic"])
        except (ValueError, KeyError, RuntimeError):  # another shape of adapter or critic: start over
            self.opt = torch.optim.AdamW(self.policy.params, lr=self.spec.optim.lr,
                                         weight_decay=self.spec.optim.weight_decay)
            return "fresh"
        for group in self.opt.param_groups:
            group["lr"], group["weight_decay"] = self.spec.optim.lr, self.spec.optim.weight_decay
        if self.critic_opt is not None:
            for group in self.critic_opt.param_groups:
                group["lr"] = self.spec.sao.critic_lr
        return "continued"

    def step(self, step: int, idx: list[int], poison: bool = False) -> dict[str, Any]:
        """One optimizer step on the samples `idx`; returns the progress line's fields."""
        spec, t0 = self.spec, time.perf_counter()
        batch = collate([spec.samples[i] for i in idx], self.policy.pad_id)
        logp, hidden = self.policy.forward(batch)
        adv = self.advantages(batch, hidden, idx)
        loss, stats = policy_loss(logp, batch.rollout_logp, adv, batch.valid, spec.sao.eps_low, spec.sao.eps_high)
        if poison:  # REEF_TRAIN_FAULT=nan
            loss = loss + float("nan")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFinite(f"non-finite loss at step {step}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.params, spec.optim.max_grad_norm))
        if not math.isfinite(grad_norm):
            raise NonFinite(f"non-finite gradient at step {step}")
        self.opt.step()
        extra: dict[str, Any] = {}
        if self.critic is not None and self.critic_opt is not None:  # K updates, after the advantages used V
            targets = batch.rewards.unsqueeze(-1).expand_as(logp)
            losses = critic_update(self.critic, self.critic_opt, hidden, targets, batch.tokens,
                                   spec.sao.critic_updates)
            self.critic_updates += len(losses)
            self.totals.value_losses.append(losses[0])
            extra["value_loss"] = round(losses[0], 6)
        seconds = time.perf_counter() - t0
        self.totals.add(value, stats, adv, batch, grad_norm)
        return {"loss": value, "tokens_per_s": round(batch.n_tokens / seconds, 2),
                "clip_frac": round(stats["clip_frac"], 6), "grad_norm": round(grad_norm, 6), **extra}

    @torch.no_grad()
    def advantages(self, batch: Batch, hidden: Tensor, idx: list[int]) -> Tensor:
        """SAO: token-level GAE on the critic's values; GRPO: the sample's group advantage on every token."""
        if self.critic is not None:
            values = self.critic(hidden.detach())
            lam = length_adaptive_lambda(batch.lengths, self.spec.sao.gae_alpha)
            adv = gae_advantages(values, batch.rewards, batch.lengths, lam)
            self.totals.values_seen(values, batch)
        else:
            assert self.group_adv is not None
            adv = self.group_adv[idx].unsqueeze(-1) * batch.tokens
        return whiten(adv, batch.valid) if self.spec.sao.normalize_advantages else adv


def _critic(spec: TrainSpec, policy: Policy) -> tuple[ValueHead | None, torch.optim.Optimizer | None, int]:
    """SAO's value head: continued from init_adapter's critic file, else fresh with V = mean reward."""
    if spec.algorithm != "sao":
        return None, None, 0
    path = None if spec.init_adapter is None else spec.init_adapter / CRITIC_FILE
    if path is not None and path.is_file():
        head, updates = load_critic(path, policy.hidden_size)
    else:
        head, updates = ValueHead(policy.hidden_size, sum(s.reward for s in spec.samples) / len(spec.samples)), 0
    return head, torch.optim.AdamW(head.parameters(), lr=spec.sao.critic_lr, weight_decay=0.0), updates


@dataclass
class _Totals:
    """Job-level sums for the `done` metrics."""

    losses: list[float] = field(default_factory=list)
    value_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid: float = 0.0
    clipped: float = 0.0
    null_logprobs: int = 0
    tokens: int = 0
    abs_adv: float = 0.0
    _values: list[Tensor] = field(default_factory=list)
    _targets: list[Tensor] = field(default_factory=list)

    def add(self, loss: float, stats: dict[str, float], adv: Tensor, batch: Batch, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.valid += stats["valid_tokens"]
        self.clipped += stats["clipped_tokens"]
        self.null_logprobs += int((batch.tokens & ~batch.valid).sum())
        self.tokens += batch.n_tokens
        self.abs_adv += float(adv[batch.valid].abs().sum())

    def values_seen(self, values: Tensor, batch: Batch) -> None:
        """The critic's values before its update on this batch (explained variance, as in Fig. 4a)."""
        self._values.append(values[batch.tokens])
        self._targets.append(batch.rewards.unsqueeze(-1).expand_as(values)[batch.tokens])

    def summary(self, spec: TrainSpec, seconds: float) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "loss": sum(self.losses) / len(self.losses),
            "mean_reward": sum(s.reward for s in spec.samples) / len(spec.samples),
            "clip_frac": self.clipped / self.valid if self.valid else 0.0,
            "mean_abs_advantage": self.abs_adv / self.valid if self.valid else 0.0,
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
            "null_logprobs": self.null_logprobs,
            "samples": len(spec.samples),
            "steps": len(self.losses),
            "tokens": self.tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(self.tokens / seconds, 2) if seconds > 0 else None,
        }
        if self.value_losses:
            values, targets = torch.cat(self._values), torch.cat(self._targets)
            ones = torch.ones_like(values, dtype=torch.bool)
            metrics["value_loss"] = sum(self.value_losses) / len(self.value_losses)
            metrics["explained_variance"] = explained_variance(values, targets, ones)
        return metrics
