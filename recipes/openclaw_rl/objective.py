"""OpenClaw-RL as a trainer objective (reefd/train/objective.py): w_rl · L_pg + w_opd · L_opd on each batch.

`old` log-probs are the trainer's own: the first forward pass of the batch, detached (the recipe makes the whole
batch one micro-batch, so one optimizer step per batch and the ratio starts at 1). The teacher is the frozen base
(adapter disabled) on the turn's prompt with the judge's hint appended to its last user message, scored on the
engine's top-K ids of each response token. A sample kept past the recipe's max_staleness (`stale: weight`) has both
terms multiplied by min(exp(log p - engine log p), stale_clip) per token. Imports torch; the trainer process loads it
by path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from recipes.openclaw_rl.loss import opd_terms, pg_terms, sample_mean
from reefd.serve.chat import ChatRequest, ChatTemplate, TemplateError
from reefd.train.batch import Batch, collate, stale_weights
from reefd.train.objective import Context, Outputs
from reefd.train.spec import Rollout

HINT_PREFIX = "\n\n[Hint] "


@dataclass(frozen=True)
class OpenClawSettings:
    """The loss settings (recipes/openclaw_rl/README.md says where each default comes from)."""

    w_rl: float = field(default=1.0, metadata={"minimum": 0})
    w_opd: float = field(default=1.0, metadata={"minimum": 0})
    eps: float = field(default=0.2, metadata={"exclusiveMinimum": 0, "maximum": 1})
    eps_high: float = field(default=0.28, metadata={"exclusiveMinimum": 0})
    ratio_clamp: float = field(default=20.0, metadata={"exclusiveMinimum": 0})
    diff_clip: float = field(default=1.0, metadata={"exclusiveMinimum": 0})
    opd_set: str = "engine"  # engine: the engine's top-K; union: plus the hinted teacher's own top-K
    stale_clip: float = field(default=2.0, metadata={"minimum": 1})  # a stale sample's truncated importance ratio


def with_hint(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """The conversation with `hint` appended to its last user message (to the last message if none is)."""
    out = [dict(m) for m in messages]
    at = next((i for i in range(len(out) - 1, -1, -1) if out[i].get("role") == "user"), len(out) - 1)
    content = out[at].get("content")
    if isinstance(content, list):
        out[at]["content"] = [*content, {"type": "text", "text": HINT_PREFIX.lstrip("\n") + hint}]
    else:
        out[at]["content"] = f"{content or ''}{HINT_PREFIX}{hint}"
    return out


class OpenClawObjective:
    """PPO-clip on the judge's verdict (turns with a ±1 verdict) plus top-K on-policy distillation from the hinted
    frozen base (turns with a hint and a full top-K capture)."""

    Settings: ClassVar[type] = OpenClawSettings
    needs: ClassVar[tuple[str, ...]] = ("extra",)

    def __init__(self, settings: OpenClawSettings, ctx: Context) -> None:
        if settings.opd_set not in ("engine", "union"):
            raise ValueError(f"settings.opd_set: {settings.opd_set!r} is not engine or union")
        self.settings, self.ctx = settings, ctx
        self.teachers = self._teacher_prompts(ctx)
        if settings.opd_set == "union":
            self._widen(ctx)
        self.sums: dict[str, float] = {"pg": 0.0, "opd": 0.0, "rl_samples": 0.0, "opd_samples": 0.0,
                                       "opd_tokens": 0.0, "adv_abs": 0.0, "stale_tokens": 0.0, "stale_weight": 0.0}

    def _teacher_prompts(self, ctx: Context) -> dict[int, list[int]]:
        """Each OPD sample's teacher prompt: its prompt with the chosen hint (the shortest), rendered by the base's
        own chat template. A sample whose prompt does not render back to its recorded ids trains no OPD."""
        self.mismatched = 0
        wanted = [i for i, s in enumerate(ctx.samples) if (s.extra or {}).get("opd") and s.top_ids is not None]
        if not wanted or ctx.base_model is None:
            return {}
        template = ChatTemplate(ctx.base_model)
        out: dict[int, list[int]] = {}
        for i in wanted:
            s, extra = ctx.samples[i], ctx.samples[i].extra or {}
            messages, tools, hints = extra.get("messages") or [], extra.get("tools") or [], extra.get("hints") or []
            try:
                if template.prompt_ids(ChatRequest(messages=messages, max_tokens=1, tools=tools)) != s.prompt_ids:
                    self.mismatched += 1
                    continue
                out[i] = template.prompt_ids(ChatRequest(messages=with_hint(messages, hints[0]), max_tokens=1,
                                                         tools=tools))
            except (TemplateError, IndexError):
                self.mismatched += 1
        return out

    def _widen(self, ctx: Context, chunk: int = 8) -> None:
        """The union set: each OPD sample's engine top-K plus the K most likely ids of the hinted teacher that are
        not among them, so a token the teacher prefers but the policy ranks low can be taught. Samples without a
        teacher keep no set (their rows are masked)."""
        for i, s in enumerate(ctx.samples):
            if s.top_ids is not None and i not in self.teachers:
                ctx.samples[i] = replace(s, top_ids=None)
        rows = sorted(self.teachers)
        if not rows or ctx.reference is None:
            return
        for lo in range(0, len(rows), chunk):
            part = rows[lo:lo + chunk]
            first = ctx.samples[part[0]].top_ids
            k = len(first[0]) if first else 1
            own = ctx.reference(self._teacher_batch(part), own_top=2 * k).own_top_ids
            assert own is not None
            for j, i in enumerate(part):
                s = ctx.samples[i]
                assert s.top_ids is not None
                widened = [list(ids) + [v for v in own[j, t].tolist() if v not in ids][:k]
                           for t, ids in enumerate(s.top_ids)]
                ctx.samples[i] = replace(s, top_ids=widened)

    def _teacher_batch(self, rows: list[int]) -> Batch:
        """Samples `rows` with their teacher prompts (hint appended), as one batch for the reference model."""
        samples: list[Rollout] = [replace(self.ctx.samples[i], prompt_ids=self.teachers[i]) for i in rows]
        return collate(samples, list(range(len(rows))), pad_id=0)

    def _teacher(self, batch: Batch) -> Tensor | None:
        """[B, T, K] the hinted frozen base's log-probs of the top-K ids (rows without a teacher: zeros)."""
        rows = [i for i in batch.index if i in self.teachers]
        if not rows or batch.top_ids is None or self.ctx.reference is None:
            return None
        teacher = self.ctx.reference(self._teacher_batch(rows))
        assert teacher.top_logp is not None
        out = torch.zeros_like(batch.top_ids, dtype=torch.float32)
        for j, i in enumerate(rows):
            r = batch.index.index(i)
            out[r, : teacher.top_logp.shape[1]] = teacher.top_logp[j, : out.shape[1]]
        return out

    def loss(self, batch: Batch, out: Outputs) -> tuple[Tensor, dict[str, float]]:
        s, n = self.settings, len(batch.index)
        extras = [self.ctx.samples[i].extra or {} for i in batch.index]
        rl = torch.tensor([bool(e.get("rl")) for e in extras])
        opd = torch.tensor([i in self.teachers for i in batch.index])
        total = torch.zeros((), dtype=torch.float32)
        stats: dict[str, float] = {}
        weights = self._stale_weights(batch, out)
        if bool(rl.any()):
            mask = batch.tokens & rl.unsqueeze(-1)
            pg = sample_mean(weights * pg_terms(out.logp, out.logp.detach(), batch.rewards, mask, s.eps, s.eps_high,
                                                s.ratio_clamp), mask)
            total = total + s.w_rl * pg.sum() / n
            stats["pg_loss"] = float(pg.detach().sum()) / max(int(rl.sum()), 1)
            self.sums["pg"] += float(pg.detach().sum())
            self.sums["rl_samples"] += int(rl.sum())
        teacher = self._teacher(batch) if bool(opd.any()) else None
        if teacher is not None and out.top_logp is not None:
            mask = batch.tokens & opd.unsqueeze(-1)
            terms, adv = opd_terms(out.top_logp, out.top_logp.detach(), teacher, mask, s.eps, s.eps_high,
                                   s.ratio_clamp, s.diff_clip)
            per_sample = sample_mean(weights * terms, mask)
            total = total + s.w_opd * per_sample.sum() / n
            stats["opd_loss"] = float(per_sample.detach().sum()) / max(int(opd.sum()), 1)
            self.sums["opd"] += float(per_sample.detach().sum())
            self.sums["opd_samples"] += int(opd.sum())
            self.sums["opd_tokens"] += int(mask.sum())
            self.sums["adv_abs"] += float(adv.abs().sum(dim=-1)[mask].sum())
        if not total.requires_grad:  # nothing trains in this batch: a zero loss that still has a gradient
            total = total + 0.0 * out.logp.sum()
        return total, stats

    def _stale_weights(self, batch: Batch, out: Outputs) -> Tensor:
        """[B, T] the truncated ratio to the engine's logprobs on samples kept past max_staleness (1 elsewhere): the
        PPO ratio is to this batch's own first pass, so it does not correct for the releases between."""
        weights = stale_weights(batch, out.logp, self.settings.stale_clip)
        if batch.stale is not None and bool(batch.stale.any()):
            stale = batch.tokens & batch.stale.unsqueeze(-1)
            self.sums["stale_tokens"] += int(stale.sum())
            self.sums["stale_weight"] += float(weights[stale].sum())
        return weights

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {}

    def save(self, folder: Path) -> None:
        return None

    def metrics(self) -> dict[str, Any]:
        m = self.sums
        out = {"rl_samples": int(m["rl_samples"]), "opd_samples": int(m["opd_samples"]),
               "pg_loss": m["pg"] / m["rl_samples"] if m["rl_samples"] else 0.0,
               "opd_loss": m["opd"] / m["opd_samples"] if m["opd_samples"] else 0.0,
               "opd_mean_abs_advantage": m["adv_abs"] / m["opd_tokens"] if m["opd_tokens"] else 0.0,
               "teacher_prompt_mismatches": self.mismatched}
        if m["stale_tokens"]:  # the mean importance weight of the stale samples' tokens
            out["stale_weight"] = m["stale_weight"] / m["stale_tokens"]
        return out
