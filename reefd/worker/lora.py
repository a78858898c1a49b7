"""Each row of a batch with its own LoRA adapter, in one forward pass, as Punica and S-LoRA batch them.

Every Linear layer an adapter targets keeps the resident adapters' factors stacked by slot: A as
(slots, in, rank) and B, already multiplied by the adapter's scaling, as (slots, rank, out), ranks zero-padded
to the largest (the padding adds nothing). Slot 0 is the base model: zeros. A forward gathers each row's slot
and adds x·A·B with two batched matmuls, however many adapters the batch holds; a batch on one adapter
multiplies by that adapter's factors directly, and a layer none of the batch's adapters targets adds nothing.

PEFT's own mixed-batch path (`adapter_names=`) runs a sub-batch per adapter in every layer instead: with 8
adapters among 8 rows, 16 small matmuls and their indexing per layer, which cost a mixed decode step about a
third of its speed on a CPU (bench/users.py). The math is PEFT's LoRA: base(x) + B(A(x)) · scaling, with
scaling lora_alpha / r (lora_alpha / √r with use_rslora) and rank_pattern / alpha_pattern per module. Folders
come checked by reefd.commit.adapters (a plain LoRA on Linear layers, safetensors, shapes that fit).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from reefd.commit.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, module_value

_PREFIX = "base_model.model."  # PEFT's saved keys: base_model.model.<module>.lora_A.weight


class Factors:
    """One Linear layer's LoRA factors, one slot per resident adapter."""

    def __init__(self, linear: torch.nn.Linear, slots: int) -> None:
        weight = linear.weight
        self.a = weight.new_zeros((slots, linear.in_features, 1))
        self.b = weight.new_zeros((slots, 1, linear.out_features))
        self.used: set[int] = set()

    def grow(self, slots: int, rank: int) -> None:
        """Room for `slots` slots of rank `rank` (kept as they are; new room is zeros)."""
        have, width = self.a.shape[0], self.a.shape[2]
        if slots <= have and rank <= width:
            return
        slots, rank = max(slots, have), max(rank, width)
        a, b = self.a.new_zeros((slots, self.a.shape[1], rank)), self.b.new_zeros((slots, rank, self.b.shape[2]))
        a[:have, :, :width], b[:have, :width, :] = self.a, self.b
        self.a, self.b = a, b

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` holds A (r, in) and B (out, r), B already scaled, as PEFT saves them."""
        rank = a.shape[0]
        self.grow(slot + 1, rank)
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :, :rank] = a.T
        self.b[slot, :rank, :] = b.T
        self.used.add(slot)

    def clear(self, slot: int) -> None:
        if slot in self.used:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.used.discard(slot)

    def delta(self, x: torch.Tensor, rows: Rows) -> torch.Tensor | None:
        """What the batch's adapters add to this layer's output for `x` (rows, ..., in); None: nothing."""
        if not self.used & rows.slots:
            return None
        if rows.uniform is not None:
            return (x @ self.a[rows.uniform]) @ self.b[rows.uniform]
        if x.shape[0] != rows.index.numel():  # a layer fed flattened or routed tokens (an MoE expert, say)
            raise RuntimeError(f"a LoRA layer got {x.shape[0]} rows of input for a batch of {rows.index.numel()}: "
                               "this model's targeted layers cannot batch different adapters row by row")
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        h = torch.bmm(flat, self.a.index_select(0, rows.index))
        return torch.bmm(h, self.b.index_select(0, rows.index)).reshape(*x.shape[:-1], -1)


class Rows:
    """Which slot each row of the forward under way reads: one slot for every row, or a slot per row."""

    def __init__(self, slots: list[int], device: torch.device) -> None:
        self.slots = frozenset(slots)
        self.uniform = slots[0] if len(self.slots) == 1 else None
        self.index = torch.tensor(slots, device=device)


class RowLoRA:
    """The resident adapters of one model, by name, and the slot each row of a forward reads."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.slot: dict[str, int] = {}  # adapter name -> its slot (>= 1)
        self.layers: dict[str, Factors] = {}  # module name -> its factors, once some adapter targets it
        self._rows: Rows | None = None

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """During the block, row i of the model's input reads adapter `names[i]` (None: the base model)."""
        missing = sorted({n for n in names if n is not None and n not in self.slot})
        if missing:
            raise RuntimeError(f"no LoRA adapter is loaded under {missing}")
        slots = [0 if n is None else self.slot[n] for n in names]
        self._rows = None if not any(slots) else Rows(slots, self.device)
        try:
            yield
        finally:
            self._rows = None

    @torch.no_grad()
    def load(self, name: str, path: Path) -> None:
        """Read a checked PEFT LoRA folder into a free slot; on any failure no slot holds any of it (a layer it
        was the first to target keeps zero factors, which add nothing)."""
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        if config.get("lora_bias"):
            raise ValueError("lora_bias is set; LoRA adapters with a bias are not supported")
        from safetensors.torch import load_file

        tensors = load_file(str(path / ADAPTER_WEIGHTS))
        pairs = _pairs(tensors)
        modules = dict(self.model.named_modules())
        unknown = sorted(m for m in pairs if not isinstance(modules.get(m), torch.nn.Linear))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a Linear layer of the served model")
        scaled = {m: (a.float().to(self.device), (b.float() * _scaling(m, a.shape[0], config)).to(self.device))
                  for m, (a, b) in pairs.items()}
        slot = min(set(range(1, len(self.slot) + 2)) - set(self.slot.values()))
        try:
            for factors in self.layers.values():  # every layer has a row for every slot, targeted or not
                factors.grow(slot + 1, 1)
            for module, (a, b) in scaled.items():
                self._factors(module, modules[module]).put(slot, a, b)
        except BaseException:
            for factors in self.layers.values():
                factors.clear(slot)
            raise
        self.slot[name] = slot

    def unload(self, name: str) -> None:
        slot = self.slot.pop(name)
        for factors in self.layers.values():
            factors.clear(slot)

    def _factors(self, name: str, linear: torch.nn.Linear) -> Factors:
        """The layer's factors; the first adapter to target it hooks the layer's output."""
        if name not in self.layers:
            factors = self.layers[name] = Factors(linear, max(self.slot.values(), default=0) + 2)

            def add(_: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
                rows = self._rows
                added = None if rows is None else factors.delta(args[0], rows)
                return None if added is None else out + added

            linear.register_forward_hook(add)
        return self.layers[name]

    @torch.no_grad()
    def misload(self, name: str, fault: str, last: str | None) -> None:
        """A test fault (reefd.worker.params.FAULTS) on the adapter just loaded, whose load still says success."""
        slot = self.slot[name]
        mine = {n: f for n, f in sorted(self.layers.items()) if slot in f.used}
        if fault == "empty-adapters":  # serves the base model under the adapter's name
            for f in mine.values():
                f.b[slot].zero_()
        elif fault == "corrupt-adapters" and mine:  # one tensor of it damaged
            next(iter(mine.values())).b[slot].mul_(-3.0)
        elif fault == "scaled-layer":  # the first decoder layer's LoRA 1.1 times what it should be
            for f in (f for n, f in mine.items() if ".layers.0." in f".{n}"):
                f.b[slot].mul_(1.1)
        elif fault == "stale-adapters" and last is not None:  # the last adapter's factors under the new name
            for f in self.layers.values():
                f.clear(slot)
                if self.slot[last] in f.used:
                    f.a[slot], f.b[slot] = f.a[self.slot[last]], f.b[self.slot[last]]
                    f.used.add(slot)


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (lora_A weight (r, in), lora_B weight (out, r)) of PEFT's saved keys."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if key.endswith(suffix):
                module = key[: -len(suffix)].removeprefix(_PREFIX)
                halves.setdefault(module, {})[half] = value
    return {m: (h["lora_A"], h["lora_B"]) for m, h in halves.items() if len(h) == 2}


def _scaling(module: str, rank: int, config: dict[str, Any]) -> float:
    """PEFT's LoRA scaling for `module`: lora_alpha / r, or lora_alpha / √r with use_rslora."""
    alpha = float(module_value(module, {"": config.get("lora_alpha", 8), **(config.get("alpha_pattern") or {})}))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
