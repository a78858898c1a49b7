"""The model on its device: load an HF folder, prefill left-padded prompts, decode one step.

Owns tensors, devices, the tokenizer and the EOS set. Knows nothing about requests,
sampling or scheduling; every call here runs on the scheduler thread.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from reefd.worker import kvcache

log = logging.getLogger("reefd.worker")


@dataclass
class Prefill:
    """The result of one prefill: cache rows, their mask, the next-token logits per row."""

    kv: kvcache.KV
    mask: torch.Tensor  # (rows, columns) 1 for real tokens
    last_logits: torch.Tensor  # (rows, vocab)
    all_logits: torch.Tensor | None  # (rows, last `keep` columns, vocab) when input logprobs were asked


class Engine:
    """A causal LM and its tokenizer, in float32 on CUDA when present, else CPU.

    Attention is PyTorch SDPA: a prompt without padding runs causal attention with no mask
    tensor at all, so a 40k-token prefill needs memory linear in its length.
    """

    def __init__(self, path: Path, device: str | None = None, context_length: int | None = None) -> None:
        hf_logging.disable_progress_bar()
        self.path = Path(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, attn_implementation="sdpa")
        self.model: Any = model.float().to(self.device).eval()
        self.config = self.model.config
        if self.device.type == "cpu":
            _use_weight_major_linears(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        # The model's own length, unless the operator sets a shorter one (SGLang's --context-length).
        model_length = int(getattr(self.config, "max_position_embeddings", 0) or 4096)
        if context_length is not None and not 2 <= context_length <= model_length:
            raise ValueError(f"context length {context_length} is outside [2, {model_length}] for {self.path}")
        self.context_length = context_length or model_length
        self.eos_ids = self._eos_ids()
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns there).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        log.info(
            "loaded %s on %s (vocab %d, context %d, attention %s, eos %s)",
            self.path,
            self.device,
            self.vocab_size,
            self.context_length,
            self.config._attn_implementation,
            sorted(self.eos_ids),
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
            getattr(self.config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def prefill(self, prompts: Sequence[Sequence[int]], keep: int = 1) -> Prefill:
        """Run left-padded prompts through the model (position ids = cumsum(mask) - 1).

        `keep` > 1 also returns the logits of the last `keep` columns (for prompt logprobs).
        Without padding no attention mask is passed: SDPA's causal kernel then materialises
        nothing quadratic in the prompt length (a padded batch costs a (rows, 1, q, k) mask).
        """
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        padded = any(len(p) < width for p in prompts)
        out = self.model(
            input_ids=ids,
            attention_mask=mask if padded else None,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=max(1, keep),
            **self._cache_kwarg(self._new_cache()),
        )
        logits = out.logits
        return Prefill(kvcache.tensors(self._out_cache(out)), mask, logits[:, -1], logits if keep > 1 else None)

    def decode_step(
        self, cache: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Feed one token per row; `mask` already includes the new column."""
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions[:, None],
            use_cache=True,
            **self._cache_kwarg(cache),
        )
        return out.logits[:, -1], self._out_cache(out)

    def cache_from(self, kv: kvcache.KV) -> DynamicCache:
        return kvcache.build(kv, self.config)

    def _new_cache(self) -> DynamicCache:
        return kvcache.build([], self.config)

    def _cache_kwarg(self, cache: DynamicCache) -> dict[str, DynamicCache]:
        return {self._cache_arg: cache}

    @staticmethod
    def _out_cache(out: Any) -> DynamicCache:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values


def _use_weight_major_linears(model: torch.nn.Module) -> None:
    """On CPU, compute each Linear of 2..8 rows as (W @ x.T).T: same math, same parameters.

    With few rows, MKL's plain `x @ W.T` is the slow path on this class of CPU (measured on
    SmolLM2-135M, 8 rows: LM head 11.3 ms -> 5.7 ms, the 210 layer matmuls 33 -> 26 ms), and
    the matmuls are ~80% of a batched decode step. One row and prefill shapes are unchanged.
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = _weight_major_forward(module)  # type: ignore[method-assign]


def _weight_major_forward(linear: torch.nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not 2 <= flat.shape[0] <= 8:
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        out = (linear.weight @ flat.T).T
        if linear.bias is not None:
            out = out + linear.bias
        return out.contiguous().reshape(*x.shape[:-1], -1)

    return forward
