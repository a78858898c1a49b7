"""SAO's critic: a token-level value head on the policy's last hidden states, its MSE update and
its file (`critic.safetensors` beside the adapter, so the critic persists across jobs and releases).

The head reads detached hidden states: the critic's loss never moves the policy's LoRA (the paper
trains a separate value model). Knows nothing about the policy loss or the job's I/O.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from reefd.train import uninterrupted

FORMAT = "reef-sao-critic-v1"


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the hidden state h_t that predicts completion token t."""

    def __init__(self, hidden_size: int, init_value: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.fill_(init_value)

    @property
    def hidden_size(self) -> int:
        return int(self.linear.in_features)

    def forward(self, hidden: Tensor) -> Tensor:
        out: Tensor = self.linear(hidden).squeeze(-1)
        return out


def value_loss(values: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Token-mean squared error over the masked tokens."""
    err = torch.where(mask, (values - targets) ** 2, torch.zeros_like(values))
    return err.sum() / mask.sum().clamp(min=1)


def critic_update(head: ValueHead, optimizer: torch.optim.Optimizer, hidden: Tensor, targets: Tensor,
                  mask: Tensor, updates: int) -> list[float]:
    """`updates` AdamW steps of the head towards `targets` (K per policy step); returns each loss."""
    hidden = hidden.detach()
    losses = []
    for _ in range(updates):
        loss = value_loss(head(hidden), targets, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with uninterrupted():  # a SIGTERM never leaves the head half-updated
            optimizer.step()
        losses.append(loss.item())
    return losses


def explained_variance(values: Tensor, targets: Tensor, mask: Tensor) -> float | None:
    """1 - Var(target - V) / Var(target) over the masked tokens; None when the targets are constant."""
    v, y = values[mask].double(), targets[mask].double()
    if y.numel() < 2 or float(y.var(unbiased=False)) == 0.0:
        return None
    return float(1.0 - (y - v).var(unbiased=False) / y.var(unbiased=False))


def save_critic(head: ValueHead, path: Path, updates: int) -> None:
    tensors = {"weight": head.linear.weight.detach().reshape(-1).contiguous(),
               "bias": head.linear.bias.detach().contiguous()}
    save_file(tensors, os.fspath(path), metadata={"format": FORMAT, "hidden_size": str(head.hidden_size),
                                                  "updates": str(updates)})


def load_critic(path: Path, hidden_size: int) -> tuple[ValueHead, int]:
    """The head saved by `save_critic` and its update count; ValueError when it does not fit this model."""
    with safe_open(os.fspath(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
        meta = f.metadata() or {}
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or weight.shape != (hidden_size,) or bias.shape != (1,):
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"{path}: not a value head for hidden size {hidden_size} (weight {shape})")
    head = ValueHead(hidden_size)
    with torch.no_grad():
        head.linear.weight.copy_(weight.reshape(1, -1))
        head.linear.bias.copy_(bias)
    updates = meta.get("updates", "0")
    return head, int(updates) if updates.isdigit() else 0
