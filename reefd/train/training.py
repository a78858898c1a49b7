"""The generic training loop (trainer process only; imports torch): base model + PEFT LoRA on CPU float32, per-token
log-probs of each completion, the objective's loss, AdamW with grad-norm clipping, then the adapter and the
objective's own files. Knows no recipe or loss (the spec names its objective), nor JSON lines or exit codes.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import pickle
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reefd.commit.weights import OBJECTIVE_FOLDER, TOKENIZER_FILES
from reefd.train import NonFinite, Terminated, prefix, quiet_peft, uninterrupted
from reefd.train.batch import Batch, collate
from reefd.train.objective import Context, Objective, Outputs, resolve
from reefd.train.spec import SpecError, TrainSpec

Emit = Callable[[dict[str, Any]], None]
# Heads that are not a plain `lm_head(h)`: use the model's own forward for their logits.
_SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class Policy:
    """The base model with its LoRA (fresh from spec.lora, or continued from init_adapter); with `target: full`,
    every parameter of the base (an init_adapter merged in first) and a frozen copy as the reference."""

    def __init__(self, spec: TrainSpec) -> None:
        self.full = spec.target == "full"
        self.frozen: Any = None
        self.model: Any
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.base_model = spec.base_model
        base: Any = AutoModelForCausalLM.from_pretrained(
            spec.base_model, local_files_only=True, dtype="auto", attn_implementation="sdpa")
        self.dtype = getattr(base.config, "dtype", None) or getattr(base.config, "torch_dtype", None)
        base = base.float()
        with quiet_peft():
            if self.full:
                if spec.init_adapter is not None:  # what serves: the adapter folded into the weights
                    base = PeftModel.from_pretrained(base, str(spec.init_adapter)).merge_and_unload()
                self.frozen = copy.deepcopy(base).eval().requires_grad_(False)
                self.model = base.requires_grad_(True)
            elif spec.init_adapter is not None:
                self.model = PeftModel.from_pretrained(base, str(spec.init_adapter), is_trainable=True)
            else:
                lora = spec.lora
                config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                    target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
                self.model = get_peft_model(base, config)
        self.model.train()
        self.causal_lm: Any = self.model if self.full else self.model.get_base_model()
        self.config = self.causal_lm.config
        self.plain_head = not any(getattr(self.config, k, None) for k in _SCALED_LOGITS)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.causal_lm.get_input_embeddings().weight.shape[0])
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the adapter has no trainable parameters")
        self.share_opening = prefix.shareable(self.model, self.config)  # no dropout: a shared opening runs once

    def forward(self, batch: Batch, own_top: int = 0, model: Any = None) -> Outputs:
        """Log-probs [B, T] of the completion tokens, the hidden states [B, T, H] that predict them, the
        log-probs [B, T, K] of the batch's top-K ids when it has them, and with `own_top` the model's own
        `own_top` most likely ids at each completion position."""
        index = batch.positions.unsqueeze(-1)
        causal_lm = self.causal_lm if model is None else model
        if self.plain_head:  # the LM head only where a completion token is predicted; a shared opening runs once
            states, offset = prefix.last_hidden(causal_lm.get_decoder(), batch, self.share_opening)
            hidden = states.gather(1, (index - offset).clamp(min=0).expand(-1, -1, self.hidden_size))
            logits = causal_lm.get_output_embeddings()(hidden).float()
        else:
            call = self.model if model is None else model
            out = call(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                       output_hidden_states=True)
            hidden = out.hidden_states[-1].gather(1, index.expand(-1, -1, self.hidden_size))
            logits = out.logits.float().gather(1, index.expand(-1, -1, out.logits.shape[-1]))
        picked = logits.gather(-1, batch.completion.unsqueeze(-1)).squeeze(-1)
        norm = torch.logsumexp(logits, dim=-1)
        top = None if batch.top_ids is None else logits.gather(-1, batch.top_ids) - norm.unsqueeze(-1)
        own = logits.detach().topk(own_top, dim=-1).indices if own_top > 0 else None
        return Outputs(picked - norm, hidden, top, own)

    def reference(self, batch: Batch, own_top: int = 0) -> Outputs:
        """`forward` under the frozen base model (the adapter disabled, or the copy kept before training), no
        gradient."""
        if self.full:
            with torch.no_grad():
                out = self.forward(batch, own_top, self.frozen)
        else:
            with torch.no_grad(), self.model.disable_adapter():
                out = self.forward(batch, own_top)
        return Outputs(out.logp.detach(), out.hidden.detach(),
                       None if out.top_logp is None else out.top_logp.detach(), out.own_top_ids)


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
class Trained:
    """What a finished job hands over: the trained policy, its objective, optimizer states and the metrics."""

    policy: Policy
    objective: Objective
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        if self.policy.full:  # a full HF model folder, in the base's dtype, with the base's tokenizer
            model = self.policy.causal_lm
            if isinstance(self.policy.dtype, torch.dtype):
                model = model.to(self.policy.dtype)
            model.save_pretrained(str(folder), safe_serialization=True)
            for name in TOKENIZER_FILES:
                source = Path(self.policy.base_model) / name
                if source.is_file():
                    shutil.copyfile(source, folder / name)
            own = folder / OBJECTIVE_FOLDER  # engines read the top level only: the objective's files go apart
            own.mkdir()
            self.objective.save(own)
            if not any(own.iterdir()):
                own.rmdir()
            return
        with quiet_peft():
            self.policy.model.save_pretrained(str(folder), safe_serialization=True)
        (folder / "README.md").unlink(missing_ok=True)  # peft's model-card stub, not part of a candidate
        self.objective.save(folder)
        if self.optimizers:  # beside the adapter: a trainer started later (reefd restarted) goes on from it too
            torch.save(self.optimizers, folder / OPTIMIZER_FILE)
        key = _adapter_key(folder)
        if key is not None and self.optimizers:
            _CARRIED[key] = self.optimizers
            while len(_CARRIED) > _CARRY_MAX:
                _CARRIED.popitem(last=False)


OPTIMIZER_FILE = "optimizer.pt"  # the optimizers' states, saved beside the adapter they trained


def _saved_optimizers(adapter: Path) -> dict[str, Any] | None:
    """The optimizer states saved beside `adapter` (tensors and numbers only), or None."""
    path = adapter / OPTIMIZER_FILE
    if not path.is_file():
        return None
    try:
        states = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
        return None
    return states if isinstance(states, dict) else None


def _continue(spec: TrainSpec, optimizers: dict[str, torch.optim.Optimizer]) -> str:
    """"continued" when the adapter the job starts from has its optimizers' states (kept by this process, or
    saved beside the adapter), so that each goes on exactly as if the jobs had run back to back; else "fresh".
    This job's own hyper-parameters (lr, weight decay) apply either way."""
    key = _adapter_key(spec.init_adapter) if spec.init_adapter is not None else None
    carried = _CARRIED.get(key) if key is not None else None
    if carried is None and spec.init_adapter is not None:
        carried = _saved_optimizers(spec.init_adapter)
    if carried is None or set(carried) != set(optimizers):
        return "fresh"
    fresh = {name: [dict(g) for g in opt.param_groups] for name, opt in optimizers.items()}
    try:
        for name, opt in optimizers.items():
            opt.load_state_dict(carried[name])
    except (ValueError, KeyError, RuntimeError):  # another shape of adapter or auxiliary module: start over
        for opt in optimizers.values():
            opt.state.clear()
        return "fresh"
    finally:
        for name, opt in optimizers.items():  # the new job's hyper-parameters, whatever was loaded
            for group, new in zip(opt.param_groups, fresh[name], strict=True):
                group.update({k: v for k, v in new.items() if k != "params"})
    return "continued"


def train(spec: TrainSpec, emit: Emit) -> Trained:
    """Run every step of the job; emits start and progress, raises NonFinite/SpecError/others."""
    torch.manual_seed(spec.seed)
    objective_cls, settings = resolve(spec)
    policy = Policy(spec)
    too_big = max(max(s.prompt_ids + s.completion_ids + [t for row in s.top_ids or [] for t in row])
                  for s in spec.samples)
    if too_big >= policy.vocab_size:
        raise SpecError(f"samples: token id {too_big} is outside the model's vocabulary ({policy.vocab_size})")
    # the files the objective saved last time: beside the adapter it continues from, or (on a weights release)
    # in the weights folder's objective/ folder
    previous = spec.init_adapter
    if previous is None and (spec.base_model / OBJECTIVE_FOLDER).is_dir():
        previous = spec.base_model / OBJECTIVE_FOLDER
    objective: Objective = objective_cls(settings, Context(spec.samples, policy.hidden_size, previous,
                                                           spec.base_model, policy.reference))
    opt = torch.optim.AdamW(policy.params, lr=spec.optim.lr, weight_decay=spec.optim.weight_decay,
                            betas=(spec.optim.beta1, spec.optim.beta2))
    optimizers = {"policy": opt, **objective.optimizers()}
    origin = _continue(spec, optimizers)
    emit({"event": "start", "samples": len(spec.samples), "steps": spec.steps,
          "trainable_params": sum(p.numel() for p in policy.params)})
    fault, hold = (spec.fault.kind, spec.fault.hold) if spec.fault else (None, Path())
    while fault == "hang" or (fault == "hold" and hold.exists()):  # tests: hang never trains; hold waits
        time.sleep(0.05)
    gen = torch.Generator().manual_seed(spec.seed)
    totals, step, started = _Totals(), 0, time.perf_counter()
    stopped = False
    try:
        for _ in range(spec.optim.epochs):
            order = torch.randperm(len(spec.samples), generator=gen).tolist()
            for lo in range(0, len(order), spec.optim.micro_batch):
                step += 1
                batch = collate(spec.samples, order[lo : lo + spec.optim.micro_batch], policy.pad_id)
                t0 = time.perf_counter()
                line, grad_norm = _step(spec, policy, objective, opt, batch, step, poison=fault == "nan" and step == 1)
                with uninterrupted():  # SIGTERM stops a step before this point (nothing changed) or after it
                    opt.step()
                    line["tokens_per_s"] = round(batch.n_tokens / (time.perf_counter() - t0), 2)
                    totals.add(line["loss"], grad_norm, batch)
                    emit({"event": "progress", "step": step, "steps": spec.steps, **line})
                if fault == "crash":
                    os._exit(137)
                while fault == "pause" and hold.exists():  # tests: waits after each step while `hold` exists
                    time.sleep(0.05)
    except Terminated:
        if not totals.losses:  # nothing trained: nothing to keep
            raise
        stopped = True
    metrics = {**totals.summary(spec, time.perf_counter() - started), **objective.metrics(), "optimizer": origin}
    if stopped:
        metrics["stopped"] = True
    return Trained(policy, objective, metrics, {name: o.state_dict() for name, o in optimizers.items()})


def _step(spec: TrainSpec, policy: Policy, objective: Objective, opt: torch.optim.Optimizer, batch: Batch,
          step: int, poison: bool = False) -> tuple[dict[str, Any], float]:
    """A micro-batch's loss and gradient, clipped (the caller steps the optimizer); returns the progress line's
    fields and the gradient's norm."""
    loss, stats = objective.loss(batch, policy.forward(batch))
    if poison:  # fault nan
        loss = loss + float("nan")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFinite(f"non-finite loss at step {step}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.params, spec.optim.max_grad_norm))
    if not math.isfinite(grad_norm):
        raise NonFinite(f"non-finite gradient at step {step}")
    line = {"loss": value, "grad_norm": round(grad_norm, 6), **{k: round(float(v), 6) for k, v in stats.items()}}
    return line, grad_norm


@dataclass
class _Totals:
    """Job-level sums for the `done` metrics that every objective shares."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    null_logprobs: int = 0
    tokens: int = 0

    def add(self, loss: float, grad_norm: float, batch: Batch) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.null_logprobs += int((batch.tokens & ~batch.valid).sum())
        self.tokens += batch.n_tokens

    def summary(self, spec: TrainSpec, seconds: float) -> dict[str, Any]:
        return {
            "loss": sum(self.losses) / len(self.losses),
            "mean_reward": sum(s.reward for s in spec.samples) / len(spec.samples),
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms), "null_logprobs": self.null_logprobs,
            "samples": len(spec.samples), "steps": len(self.losses), "tokens": self.tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(self.tokens / seconds, 2) if seconds > 0 else None}
