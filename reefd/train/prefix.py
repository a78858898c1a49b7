"""The decoder's last hidden states for a micro-batch whose rows open with the same tokens, those tokens run once.

A chat template's system prompt and the fixed words of a task family make most of a short prompt, and every row of
a micro-batch repeats them. Here the shared opening runs at batch 1, its keys and values are expanded (a view, no
copy) to every row, and only the rest of each row runs at full batch, attending to them. The gradient of every row
flows back through the expansion into the one opening, so the loss and the gradient are those of the plain forward
(to float rounding; tests/train/test_prefix.py). On SmolLM2 a step of 16 practice answers whose 44-token prompts
share 27 tokens costs 1.17 s instead of 1.80 s on this project's CPU (bench/shared_openings.py).

Imports torch: trainer process only. Knows nothing about losses, adapters or files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from reefd.train.batch import Batch
from reefd.worker import kvcache

MIN_SHARED = 8  # a shorter shared opening is not worth a second forward call


def shared_length(batch: Batch) -> int:
    """How many leading tokens to run once: the tokens every row has in common, stopping before the first position
    whose output predicts a completion token (each row keeps those outputs in its own part). 0: not worth it."""
    ids, mask = batch.input_ids, batch.attention_mask
    if ids.shape[0] < 2 or batch.positions.shape[1] == 0:
        return 0
    same = ((ids == ids[:1]) & (mask == 1)).all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    first = batch.positions[:, 0][batch.tokens[:, 0]]  # each row with a completion: where its prediction starts
    real = mask.sum(dim=1)
    limit = min(int(first.min()) if first.numel() else common, int(real.min()) - 1)
    shared = min(common, limit)
    return shared if shared >= MIN_SHARED else 0


def shareable(model: torch.nn.Module, config: Any) -> bool:
    """Whether a training forward of `model` (its transformers `config`) draws no dropout. With dropout every row
    draws its own mask, so the rows' opening cannot be one forward: a LoRA with `dropout` > 0, or a base model
    whose config sets some (`attention_dropout`, GPT-2's `resid_pdrop`, ...)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return False
    return not any(isinstance(v, float) and v > 0 for k, v in config.to_dict().items()
                   if "dropout" in k or k.endswith("pdrop"))


def last_hidden(decoder: Any, batch: Batch, share: bool = True) -> tuple[Tensor, int]:
    """(the decoder's last hidden states, the input position of their first column): [B, L, H] and 0 when rows
    share too little (or `share` is off: see `shareable`), else [B, L - P, H] and P, the shared opening having run
    once."""
    shared = shared_length(batch) if share else 0
    if not shared:
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return out.last_hidden_state, 0
    rows, width = batch.input_ids.shape
    arg = kvcache.cache_arg(decoder)
    head = decoder(input_ids=batch.input_ids[:1, :shared], use_cache=True)
    cache = kvcache.empty(decoder.config)  # concatenating layers: the worker's in-place ones are for inference
    for layer, (keys, values) in enumerate(kvcache.tensors(kvcache.returned(head))):
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
    positions = torch.arange(shared, width, device=batch.input_ids.device).expand(rows, -1)  # right padded
    out = decoder(input_ids=batch.input_ids[:, shared:], attention_mask=batch.attention_mask,
                  position_ids=positions, use_cache=True, **{arg: cache})
    return out.last_hidden_state, shared

