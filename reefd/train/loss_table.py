"""The Tinker API's built-in losses as the daemon checks requests for them (torch-free; reefd imports it): each
loss's `loss_fn_inputs` besides `target_tokens`, and its `loss_fn_config` keys with their defaults. The losses
themselves are in losses.py (trainer process)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossSpec:
    needs: tuple[str, ...]
    config: dict[str, float] = field(default_factory=dict)


_RL = ("logprobs", "advantages")
LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("weights",)),
    "importance_sampling": LossSpec(_RL),
    "ppo": LossSpec(_RL, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(_RL, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(_RL, {"beta": 0.05}),
}
