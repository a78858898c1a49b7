"""TTT-Discover as a Reef recipe: a grid of scored attempts -> one LoRA step with entropic advantages.

The daemon side (no torch). A client, the solver loop, asks reefd for the next step (reefd/grow/attempts.py): G parent
states chosen by PUCT from the scenario's archive (archive.py), each with the prompt to send. It sends R attempts
per state through the normal APIs and reports each with `metadata: {step, group, rollout}` and its score. Once the
grid is full, this recipe turns it into a trainer job: per group, entropic leave-one-out advantages (entropic.py),
groups whose rewards are all equal dropped; the loss runs in the trainer process (objective.py).
recipes/ttt_discover/README.md explains every parameter and where its default comes from.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recipes.ttt_discover.archive import Archive
from recipes.ttt_discover.entropic import GroupError, advantages
from reefd.grow.recipes import RecipeError, Sample, WeightJob, engine_tokens

if TYPE_CHECKING:
    from reefd.harness import Harness

DEFAULT_PROMPT = ("Here is the best solution found so far (score {score}):\n\n{state}\n\n"
                  "Write an improved solution.")
COORDINATES = ("step", "group", "rollout")


@dataclass
class TTTConfig:
    """TTT-Discover's settings (see recipes/ttt_discover/README.md for where each default comes from)."""

    groups: int = field(default=8, metadata={"minimum": 1, "description": "G: parent states per step."})
    rollouts: int = field(default=16, metadata={
        "minimum": 1, "description": "R: attempts per parent state; at least 3 (with 2 the leave-one-out "
                                     "weights blow up to about 1e12)."})
    lr: float = field(default=4e-5, metadata={"exclusiveMinimum": 0, "description": "Adam learning rate."})
    beta1: float = field(default=0.9, metadata={"minimum": 0, "exclusiveMaximum": 1})
    beta2: float = field(default=0.95, metadata={"minimum": 0, "exclusiveMaximum": 1})
    kl_coef: float = field(default=0.1, metadata={"minimum": 0,
                                                  "description": "Centered KL penalty to the frozen base."})
    max_grad_norm: float | None = field(default=None, metadata={
        "description": "null: no gradient clipping (upstream clips nothing); a number clips the step's norm."})
    lora_r: int = field(default=32, metadata={"minimum": 1, "description": "LoRA rank of a fresh adapter."})
    lora_alpha: int = field(default=64, metadata={"minimum": 1})
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    puct_c: float = field(default=1.0, metadata={"minimum": 0, "description": "PUCT exploration constant c."})
    archive_size: int = field(default=1000, metadata={"minimum": 1, "description": "States the archive keeps."})
    initial_state: str = field(default="", metadata={"description": "The archive's first state (the root)."})
    initial_score: float | None = field(default=None, metadata={"description": "Its score, if known."})
    system: str | None = field(default=None, metadata={"description": "A system message for every attempt."})
    prompt: str = field(default=DEFAULT_PROMPT, metadata={
        "description": "The user message of an attempt: {state} and {score} are the parent's."})
    temperature: float = field(default=1.0, metadata={"minimum": 0, "maximum": 2,
                                                      "description": "The sampling the next-step route suggests."})
    max_tokens: int = field(default=1024, metadata={"minimum": 1})
    train: bool = field(default=True, metadata={
        "description": "false: search only (the control: the same PUCT archive and grids with the frozen "
                       "serving release; a full grid updates the archive and trains nothing)."})
    seed: int = 0


@dataclass(frozen=True)
class Grid:
    """The shape of a step: G groups x R rollouts."""

    groups: int
    rollouts: int

    @property
    def size(self) -> int:
        return self.groups * self.rollouts


class TTTDiscover:
    """A grid of attempts at PUCT-chosen states -> one Adam step on entropic advantages (+ centered KL)."""

    Config = TTTConfig
    produces = "weights"
    objective = "recipes.ttt_discover.objective:TTTObjective"

    def __init__(self, cfg: TTTConfig) -> None:
        if cfg.rollouts < 3:
            raise RecipeError(f"recipe.params.rollouts: {cfg.rollouts} attempts per group; TTT-Discover needs at "
                              "least 3 (with 2, the leave-one-out weights blow up to about 1e12)")
        try:
            cfg.prompt.format(state="", score="")
        except (KeyError, IndexError, ValueError) as exc:
            raise RecipeError(f"recipe.params.prompt: only {{state}} and {{score}} may be filled in ({exc!r})"
                              ) from None
        self.cfg = cfg
        self.grid = Grid(cfg.groups, cfg.rollouts)
        self.puct_c = cfg.puct_c
        self.trains = cfg.train
        self.sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}

    # ------------------------------------------------------------ the search side (reefd/grow/attempts.py)

    def new_archive(self) -> Archive:
        return Archive(self.cfg.initial_state, self.cfg.initial_score, self.cfg.archive_size)

    def load_archive(self, doc: dict[str, Any]) -> Archive:
        return Archive.from_json(doc, self.cfg.archive_size)

    def messages(self, state: str, score: float | None) -> list[dict[str, Any]]:
        """The chat messages of an attempt at `state`."""
        text = self.cfg.prompt.format(state=state, score="none yet" if score is None else f"{score:g}")
        head = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return [*head, {"role": "user", "content": text}]

    def summarize(self, rewards: list[float]) -> dict[str, Any]:
        """One group's figures: its β and advantages, or why it is dropped."""
        mean = math.fsum(rewards) / len(rewards)
        if max(rewards) == min(rewards):
            return {"dropped": "every reward is equal", "mean": mean}
        try:
            beta, adv = advantages(rewards)
        except GroupError as exc:  # e.g. rewards so far apart that the weights underflow
            return {"dropped": str(exc), "mean": mean}
        return {"beta": beta, "advantages": adv, "mean": mean}

    # ------------------------------------------------------------ the recipe contract

    def sample(self, record: dict[str, Any], reports: list[dict[str, Any]]) -> Sample | None:
        """An attempt: a record with engine token ids and logprobs and a report at a grid coordinate (none in
        search-only mode)."""
        tokens = engine_tokens(record)
        if not self.trains or tokens is None:
            return None
        prompt, ids, logprobs = tokens
        report = next((r for r in reports if coordinate(r) is not None), None)
        if report is None:
            return None
        step, group, rollout = coordinate(report) or (0, 0, 0)
        return Sample(receipt=record["id"], prompt_ids=list(prompt), completion_ids=list(ids),
                      logprobs=[None if lp is None or not math.isfinite(lp) else lp for lp in logprobs],
                      reward=float(report["score"]), group=f"{step}/{group}", reports=[report["report_id"]],
                      extra={"step": step, "group": group, "rollout": rollout},
                      context={"release": record.get("release")})

    def ready(self, samples: list[Sample]) -> bool:
        return self._full_step(samples) is not None

    def _full_step(self, samples: list[Sample]) -> int | None:
        """The oldest step every coordinate of which has an attempt."""
        seen: dict[int, set[tuple[int, int]]] = defaultdict(set)
        for s in samples:
            extra = s.extra or {}
            if 0 <= extra["group"] < self.grid.groups and 0 <= extra["rollout"] < self.grid.rollouts:
                seen[extra["step"]].add((extra["group"], extra["rollout"]))
        full = [step for step, cells in seen.items() if len(cells) == self.grid.size]
        return min(full) if full else None

    def candidate(self, samples: list[Sample], harness: Harness | None = None) -> WeightJob:
        c = self.cfg
        step = self._full_step(samples)
        if step is None:
            raise RecipeError(f"no full grid of {c.groups} x {c.rollouts} attempts yet")
        groups: dict[int, dict[int, Sample]] = defaultdict(dict)
        for s in samples:
            extra = s.extra or {}
            if extra["step"] == step:
                groups[extra["group"]].setdefault(extra["rollout"], s)
        kept: list[Sample] = []
        skipped: list[str] = []
        for g in sorted(groups):
            attempts = [groups[g][r] for r in sorted(groups[g])]
            rewards = [s.reward for s in attempts]
            try:
                beta, adv = advantages(rewards)
            except GroupError:  # every reward equal: nothing to learn from this group
                skipped += [s.receipt for s in attempts]
                continue
            for s, a in zip(attempts, adv, strict=True):
                kept.append(Sample(s.receipt, s.prompt_ids, s.completion_ids, s.logprobs, s.reward, s.group,
                                   s.reports, None, {**(s.extra or {}), "advantage": a, "beta": beta}, s.context))
        if not kept:
            raise RecipeError(f"step {step}: every group's rewards are equal, so there is nothing to learn")
        return WeightJob(
            objective=self.objective, samples=kept,
            lora={"r": c.lora_r, "alpha": c.lora_alpha, "dropout": 0.0, "target_modules": list(c.target_modules)},
            optim={"lr": c.lr, "weight_decay": 0.0, "epochs": 1, "micro_batch": len(kept),  # one Adam step
                   "max_grad_norm": 1e30 if c.max_grad_norm is None else c.max_grad_norm,
                   "beta1": c.beta1, "beta2": c.beta2},
            settings={"kl_coef": c.kl_coef}, seed=c.seed + step, skipped=skipped)


def coordinate(report: dict[str, Any]) -> tuple[int, int, int] | None:
    """A report's (step, group, rollout), or None when it has none (or a score that is not finite)."""
    meta = report.get("metadata")
    score = report.get("score")
    if not isinstance(meta, dict) or not isinstance(score, int | float) or isinstance(score, bool):
        return None
    values = [meta.get(k) for k in COORDINATES]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(ints) != len(COORDINATES) or not math.isfinite(score):
        return None
    return ints[0], ints[1], ints[2]
