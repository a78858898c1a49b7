"""Row surgery on a transformers KV cache: merge batches, drop rows, trim shared padding; and
a cache layer that grows in place.

Owns the only code that looks inside a `DynamicCache` (its layout changed across
transformers versions). Knows nothing about requests, sampling or tokenizers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

try:  # transformers >= 4.56: a cache is a list of layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older: plain key/value lists, which grow by concatenation
    DynamicLayer = None

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (batch, heads, seq, dim)


def cache_arg(model: Any) -> str:
    """What a transformers model's forward calls its KV cache: transformers 5 renamed `past_key_values` to `cache`
    (the old name warns there)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def tensors(cache: DynamicCache) -> KV:
    """The per-layer (keys, values) tensors of `cache`."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


SLACK = 256  # columns a new buffer holds beyond its contents


if DynamicLayer is not None:

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are views of buffers with spare columns.

        transformers' layer concatenates on every update, so each decode step copies the whole
        cache: time per token grows with the length (about 40 ms a token at 4k tokens on the
        tiny model, most of it in `torch.cat`). Here a step writes its one column into the spare
        room; a full buffer is replaced by one half as large again, so copying stays amortised
        O(1) per token and the spare room at most a third of the buffer.
        """

        _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        keys: torch.Tensor | None
        values: torch.Tensor | None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            assert self.keys is not None and self.values is not None
            if self._buffers is None or self._buffers[0].data_ptr() != self.keys.data_ptr():
                self._buffers = None  # first update, or another method replaced the tensors (crop, reorder)
            used = self.keys.shape[-2] if self.keys.numel() else 0
            need = used + key_states.shape[-2]
            if self._buffers is None or need > self._buffers[0].shape[-2]:
                room = need + (SLACK if self._buffers is None else max(SLACK, need // 2))
                self._buffers = (_grown(self.keys, key_states, used, room),
                                 _grown(self.values, value_states, used, room))
            keys, values = self._buffers
            keys[..., used:need, :] = key_states
            values[..., used:need, :] = value_states
            self.keys, self.values = keys[..., :need, :], values[..., :need, :]
            return self.keys, self.values


def _grown(old: torch.Tensor, new: torch.Tensor, used: int, room: int) -> torch.Tensor:
    """A buffer of `room` columns shaped like `new`, holding the first `used` columns of `old`."""
    buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
    if used:
        buffer[..., :used, :] = old[..., :used, :]
    return buffer


def empty(config: PretrainedConfig) -> DynamicCache:
    """A fresh transformers cache for `config`'s layers, whose layers concatenate (autograd follows that)."""
    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def returned(out: Any) -> DynamicCache:
    """The cache a forward returned (transformers 5 calls it `cache`, older versions `past_key_values`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def build(kv: KV, config: PretrainedConfig) -> DynamicCache:
    """A fresh cache holding `kv`, filled through the public `update` API; its full-attention layers grow in place."""
    cache = empty(config)
    layers = getattr(cache, "layers", None)
    if DynamicLayer is not None and isinstance(layers, list):
        cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in layers]
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
    kv = [(torch.cat([_left_pad(ka, length), _left_pad(kb, length)]),
           torch.cat([_left_pad(va, length), _left_pad(vb, length)]))
          for (ka, va), (kb, vb) in zip(a, b, strict=True)]

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
