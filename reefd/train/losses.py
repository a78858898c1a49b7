"""The Tinker API's built-in losses (trainer process only; imports torch), each on one datum: per-position log-probs
`logp` [N] of its target tokens under the policy, with gradient, and its `loss_fn_inputs` as tensors [N]. A loss
is a sum over positions (and the step's over datums), as Tinker's are; `elementwise_loss` is what each position
adds. The names, inputs and config keys are Tinker's, in loss_table.py (reefd checks requests against it before
they reach the trainer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Inputs = dict[str, Tensor]
Config = dict[str, float]


def _cross_entropy(logp: Tensor, inputs: Inputs, cfg: Config) -> Tensor:
    return -logp * inputs["weights"]


def _ratio(logp: Tensor, inputs: Inputs) -> Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _importance_sampling(logp: Tensor, inputs: Inputs, cfg: Config) -> Tensor:
    return -_ratio(logp, inputs) * inputs["advantages"]


def _ppo(logp: Tensor, inputs: Inputs, cfg: Config) -> Tensor:
    ratio, adv = _ratio(logp, inputs), inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(logp: Tensor, inputs: Inputs, cfg: Config) -> Tensor:
    """The clipped ratio as a constant weight on the log-prob's gradient (CISPO)."""
    weight = _ratio(logp, inputs).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -weight * logp * inputs["advantages"]


def _dro(logp: Tensor, inputs: Inputs, cfg: Config) -> Tensor:
    """Direct reward optimisation: the advantage-weighted log-prob, less a quadratic penalty on the log-ratio."""
    log_ratio = logp - inputs["logprobs"]
    return -(logp * inputs["advantages"] - 0.5 * cfg["beta"] * log_ratio ** 2)


# each loss's elementwise term; its inputs and config defaults are loss_table's
ELEMENTWISE: dict[str, Callable[[Tensor, Inputs, Config], Tensor]] = {
    "cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling, "ppo": _ppo, "cispo": _cispo,
    "dro": _dro,
}
