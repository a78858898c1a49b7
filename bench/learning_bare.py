"""The baseline of bench/learning.py: a bare policy-gradient loop on SmolLM2, in-process, no server.

LoRA r 8 (alpha 16) on q/k/v/o, AdamW lr 5e-4, batched sampling with HF generate at temperature 1.0 on the
whole vocabulary, advantages (score - batch mean) / (batch std + 1e-6), one REINFORCE step per batch. Knows
nothing about reefd, clocks or the task's prompts beyond the chat messages it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


class Bare:
    """A PEFT LoRA policy, its optimizer, sampling and one update per batch."""

    def __init__(self, folder: Path, *, lr: float, max_tokens: int, temperature: float, seed: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.manual_seed(seed)
        self.torch, self.max_tokens, self.temperature = torch, max_tokens, temperature
        self.tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.eos = int(self.tok.eos_token_id)

    def sample(self, prompts: list[str]) -> tuple[Any, list[str]]:
        """One answer per user prompt (chat template, generation prompt): the batch for `step`, and the texts."""
        torch = self.torch
        chats = [self.tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
        enc = self.tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=self.max_tokens, pad_token_id=self.eos)
        comp = out[:, enc["input_ids"].shape[1]:]
        is_eos = (comp == self.eos).long()
        mask = (is_eos.cumsum(1) - is_eos == 0).long()  # up to and including the first EOS (pad == eos)
        texts = [self.tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(comp, mask, strict=True)]
        return (enc["input_ids"], enc["attention_mask"], comp, mask), texts

    def step(self, batch: Any, scores: list[float]) -> float:
        """One REINFORCE update: token mean of -A log p over the completions, grad norm clipped at 1.0."""
        torch = self.torch
        prompt, prompt_mask, comp, mask = batch
        r = torch.tensor(scores)
        adv = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        ids, attn = torch.cat([prompt, comp], 1), torch.cat([prompt_mask, mask], 1)
        pos = (attn.cumsum(1) - 1).clamp(min=0)  # left padding: positions count real tokens only
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, prompt.shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, comp[..., None])[..., 0]
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return float(loss.detach())
