"""`python -m reefd.train.session`: one training session's trainer (imports torch), driven a request at a time:
a base model with a fresh LoRA held in memory, gradients accumulated over `forward_backward` calls until
`optim_step` applies them with AdamW, as the Tinker API's training client expects. reefd (reefd/tinker) speaks to
it over stdin/stdout, one JSON object per line each way:

    {"op": "init", "base_model": DIR, "rank": R, "alpha": A, "target_modules": [...], "seed": S}
    {"op": "forward_backward", "loss_fn": NAME, "config": {...}, "backward": true,
     "data": [{"tokens": [...], "inputs": {"target_tokens": [...], "weights": [...], ...}}, ...]}
        -> {"ok": {"outputs": [{"logprobs": [...], "elementwise_loss": [...]}, ...], "loss": L, "tokens": T}}
    {"op": "optim_step", "lr": .., "beta1": .., "beta2": .., "eps": .., "weight_decay": .., "grad_clip_norm": ..}
        -> {"ok": {"grad_norm": G}}
    {"op": "save", "dir": DIR, "optimizer": true}        a PEFT adapter folder (and optimizer.pt)
    {"op": "load", "dir": DIR, "optimizer": true}

A request it cannot do is answered {"error": "...", "user": true|false} (user: the request's fault) and the
session goes on; a non-finite loss or gradient applies nothing. reefd has checked shapes, names and token ids.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from reefd.train import quiet_peft, uninterrupted
from reefd.train.loss_table import LOSS_SPECS
from reefd.train.losses import ELEMENTWISE

OPTIMIZER_FILE = "optimizer.pt"


class UserError(ValueError):
    """The request cannot be done as asked (reefd answers it as the caller's error)."""


class Session:
    def __init__(self, req: dict[str, Any]) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.manual_seed(int(req.get("seed", 0)))
        base: Any = AutoModelForCausalLM.from_pretrained(req["base_model"], local_files_only=True, dtype="auto",
                                                         attn_implementation="sdpa")
        config = LoraConfig(r=int(req["rank"]), lora_alpha=int(req.get("alpha") or 2 * int(req["rank"])),
                            lora_dropout=0.0, target_modules=list(req["target_modules"]), task_type="CAUSAL_LM")
        with quiet_peft():
            self.model = get_peft_model(base.float(), config)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.vocab = int(self.model.get_base_model().get_input_embeddings().weight.shape[0])

    def forward_backward(self, req: dict[str, Any]) -> dict[str, Any]:
        """Each datum's forward pass and loss, its gradient added to .grad (summed with earlier calls' until
        optim_step); a datum whose loss is not finite fails the whole request, and .grad is as it was before it."""
        elementwise_of = ELEMENTWISE[req["loss_fn"]]
        cfg = {**LOSS_SPECS[req["loss_fn"]].config, **req.get("config", {})}
        backward = bool(req.get("backward", True))
        before = [None if p.grad is None else p.grad.clone() for p in self.params] if backward else []
        outputs: list[dict[str, list[float]]] = []
        total, tokens = 0.0, 0
        try:
            with torch.set_grad_enabled(backward):
                for datum in req["data"]:
                    out, value = self._datum(datum, elementwise_of, cfg, backward)
                    outputs.append(out)
                    total += value
                    tokens += len(datum["tokens"])
        except UserError:
            for param, grad in zip(self.params, before, strict=True):
                param.grad = grad
            raise
        return {"outputs": outputs, "loss": total, "tokens": tokens}

    def _datum(self, datum: dict[str, Any], elementwise_of: Any, cfg: dict[str, float],
               backward: bool) -> tuple[dict[str, list[float]], float]:
        tokens_in = torch.tensor([datum["tokens"]], dtype=torch.long)
        inputs = {k: torch.tensor(v, dtype=torch.long if k == "target_tokens" else torch.float32)
                  for k, v in datum["inputs"].items()}
        logits = self.model(input_ids=tokens_in, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, inputs["target_tokens"].unsqueeze(-1)).squeeze(-1)
        elementwise = elementwise_of(logp, inputs, cfg)
        loss = elementwise.sum()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise UserError(f"a datum's loss is not finite ({value}): nothing of this request was applied")
        if backward:
            loss.backward()
        return {"logprobs": logp.detach().tolist(), "elementwise_loss": elementwise.detach().tolist()}, value

    def optim_step(self, req: dict[str, Any]) -> dict[str, Any]:
        clip = float(req.get("grad_clip_norm") or 0.0)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if not math.isfinite(norm):
            self.opt.zero_grad(set_to_none=True)
            raise UserError(f"the accumulated gradient is not finite ({norm}); nothing was applied")
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        for group in self.opt.param_groups:
            group.update(lr=float(req["lr"]), betas=(float(req["beta1"]), float(req["beta2"])),
                         eps=float(req["eps"]), weight_decay=float(req.get("weight_decay", 0.0)))
        with uninterrupted():
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    def save(self, req: dict[str, Any]) -> dict[str, Any]:
        out = Path(req["dir"])
        with uninterrupted():
            self.model.save_pretrained(str(out))
            if req.get("optimizer", True):
                torch.save(self.opt.state_dict(), out / OPTIMIZER_FILE)
        return {"files": sorted(p.name for p in out.iterdir())}

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        folder = Path(req["dir"])
        with uninterrupted():
            set_peft_model_state_dict(self.model, load_file(str(folder / "adapter_model.safetensors")))
            if req.get("optimizer", True) and (folder / OPTIMIZER_FILE).is_file():
                self.opt.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
            else:
                self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        return {}


OPS = {"forward_backward": Session.forward_backward, "optim_step": Session.optim_step, "save": Session.save,
       "load": Session.load}


def answer(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def main() -> int:
    session: Session | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if req["op"] == "init":
                session = Session(req)
                answer({"ok": {"vocab_size": session.vocab,
                               "trainable_params": sum(p.numel() for p in session.params)}})
                continue
            if session is None:
                raise UserError("the session has no model yet (init first)")
            op = OPS.get(req["op"])
            if op is None:
                raise UserError(f"unknown op {req['op']!r}")
            answer({"ok": op(session, req)})
        except UserError as exc:
            answer({"error": str(exc), "user": True})
        except Exception as exc:  # the trainer's own failure: the session goes on, reefd says the server failed
            answer({"error": f"{type(exc).__name__}: {exc}", "user": False})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
