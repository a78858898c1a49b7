"""Row surgery on a transformers KV cache: merge batches, drop rows, trim shared padding.

Owns the only code that looks inside a `DynamicCache` (its layout changed across
transformers versions). Knows nothing about requests, sampling or tokenizers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (batch, heads, seq, dim)


def tensors(cache: DynamicCache) -> KV:
    """The per-layer (keys, values) tensors of `cache`."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # type: ignore[attr-defined]


def build(kv: KV, config: PretrainedConfig) -> DynamicCache:
    """A fresh cache holding `kv`, filled through the public `update` API."""
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    for idx, (keys, values) in enumerate(kv):
        cache.update(keys, values, idx)
    return cache


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - t.shape[-2]
    if missing <= 0:
        return t
    pad = t.new_zeros((*t.shape[:-2], missing, t.shape[-1]))
    return torch.cat([pad, t], dim=-2)


def merge(a: KV, mask_a: torch.Tensor, b: KV, mask_b: torch.Tensor) -> tuple[KV, torch.Tensor]:
    """Stack two batches row-wise, left-padding the shorter one (pad slots are masked out)."""
    length = max(mask_a.shape[1], mask_b.shape[1])
    kv = [
        (
            torch.cat([_left_pad(ka, length), _left_pad(kb, length)]),
            torch.cat([_left_pad(va, length), _left_pad(vb, length)]),
        )
        for (ka, va), (kb, vb) in zip(a, b, strict=True)
    ]

    def pad_mask(m: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.new_zeros((m.shape[0], length - m.shape[1])), m], dim=1)

    return kv, torch.cat([pad_mask(mask_a), pad_mask(mask_b)])


def select(kv: KV, mask: torch.Tensor, rows: list[int]) -> tuple[KV, torch.Tensor]:
    """Keep only `rows`, then drop the leading columns that are padding for every kept row."""
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    kv = [(k.index_select(0, index)[..., start:, :], v.index_select(0, index)[..., start:, :]) for k, v in kv]
    return kv, mask[:, start:]
