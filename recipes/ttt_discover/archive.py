"""TTT-Discover's archive of states: the best attempts so far, their scores and visit counts, and PUCT selection of
the states the next grid starts from (pure Python; reefd keeps one per scenario, reefd/grow/attempts.py).

A state is an attempt's answer (or what the client's scorer made of it) with its score, the release that produced
it, the step it came from and its parent. Selection scores every state as

    Q + c · scale · P · sqrt(1 + T) / (1 + n)

with Q the best score among the state's children (its own score while it has none), P a rank prior (the best of N
states gets N, the worst 1, normalized), scale the spread of the archive's scores (max − min), n the groups
expanded from the state or one of its descendants, and T the groups expanded in all. The G best-scoring states
with disjoint lineages start the next grid's groups (a state and its ancestors below the root are one lineage, so
the root itself, starting afresh, is one more); when fewer than G lineages exist, the best states are used again.
Knows nothing about records, tokens or HTTP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ROOT = "root"


@dataclass
class Node:
    """One state of the archive."""

    id: str
    state: str
    score: float | None  # None: the initial state, unless the scenario gave it a score
    parent: str | None = None
    ancestors: list[str] = field(default_factory=list)  # parent first, up to the root
    release: str | None = None  # the release whose attempt produced it
    step: int | None = None
    receipt: str | None = None  # the attempt's record
    visits: int = 0  # n: groups expanded from this state or a descendant
    best_child: float | None = None  # the best score among its children

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Selected:
    """A state chosen to start a group, with the terms of its PUCT score (shown to the client and in status)."""

    node: Node
    score: float
    q: float
    prior: float
    bonus: float


class Archive:
    """The states, the total expansions T and the per-step curve. `size` bounds the states kept (the best by
    score; the initial state always stays)."""

    def __init__(self, initial_state: str, initial_score: float | None = None, size: int = 1000) -> None:
        self.size = size
        self.nodes: dict[str, Node] = {ROOT: Node(ROOT, initial_state, initial_score)}
        self.total = 0  # T
        self.curve: list[dict[str, Any]] = []  # one entry per closed step (reefd/grow/attempts.py writes it)

    # ------------------------------------------------------------ persistence

    def as_json(self) -> dict[str, Any]:
        return {"size": self.size, "total": self.total, "nodes": [n.as_json() for n in self.nodes.values()],
                "curve": self.curve}

    @classmethod
    def from_json(cls, doc: dict[str, Any], size: int | None = None) -> Archive:
        nodes = [Node(**n) for n in doc["nodes"]]
        root = next(n for n in nodes if n.id == ROOT)
        archive = cls(root.state, root.score, size or int(doc.get("size") or 1000))
        archive.nodes = {n.id: n for n in nodes}
        archive.total = int(doc.get("total") or 0)
        archive.curve = list(doc.get("curve") or [])
        return archive

    # ------------------------------------------------------------ queries

    def scored(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.score is not None]

    def best(self) -> Node:
        """The best-scoring state (the initial one while nothing has a score)."""
        scored = self.scored()
        return min(scored, key=lambda n: (-(n.score or 0.0), _order(n))) if scored else self.nodes[ROOT]

    def _value(self, node: Node, floor: float) -> float:
        return node.score if node.score is not None else floor

    def puct(self, c: float) -> list[Selected]:
        """Every state with its PUCT score, best first (ties: the older state first)."""
        scores = [n.score for n in self.nodes.values() if n.score is not None]
        floor = min(scores) if scores else 0.0  # an unscored state ranks last and counts as the worst
        scale = max(max(scores) - min(scores), 1e-6) if len(scores) >= 2 else 1.0
        nodes = sorted(self.nodes.values(), key=lambda n: (-self._value(n, floor), n.score is None, _order(n)))
        count = len(nodes)
        weights = {n.id: float(count - rank) for rank, n in enumerate(nodes)}  # rank prior: N - rank
        total = sum(weights.values())
        growth = math.sqrt(1.0 + self.total)
        out = []
        for n in nodes:
            q = n.best_child if n.best_child is not None else self._value(n, floor)
            prior = weights[n.id] / total
            bonus = c * scale * prior * growth / (1.0 + n.visits)
            out.append(Selected(n, q + bonus, q, prior, bonus))
        out.sort(key=lambda s: (-s.score, _order(s.node)))
        return out

    def select(self, groups: int, c: float) -> list[Selected]:
        """The states that start the next `groups` groups: best PUCT score first, one per lineage; when there are
        fewer lineages than groups, the best states again, in the same order."""
        ranked = self.puct(c)
        chosen: list[Selected] = []
        taken: set[str] = set()
        for s in ranked:
            lineage = {s.node.id, *s.node.ancestors} - {ROOT} or {ROOT}
            if lineage & taken:
                continue
            chosen.append(s)
            taken |= lineage
            if len(chosen) == groups:
                return chosen
        picked = list(chosen)
        i = 0
        while len(chosen) < groups:
            chosen.append(picked[i % len(picked)])
            i += 1
        return chosen

    # ------------------------------------------------------------ updates

    def expand(self, parents: list[str], children: list[dict[str, Any]]) -> int:
        """Record a closed grid: each group's parent (one visit to it and its ancestors, T + 1 per group), and the
        children (Node fields; each updates its parent's best child). A child whose state text is already in the
        archive is not added again. Returns how many children were added; then the archive is pruned to `size`."""
        for pid in parents:
            node = self.nodes.get(pid)
            if node is None:  # pruned since the plan: its lineage is gone too
                self.total += 1
                continue
            node.visits += 1
            for aid in node.ancestors:
                if aid in self.nodes:
                    self.nodes[aid].visits += 1
            self.total += 1
        known = {n.state for n in self.nodes.values()}
        added = 0
        for fields in children:
            child = Node(**fields)
            parent = self.nodes.get(child.parent or "")
            if parent is not None and child.score is not None:
                parent.best_child = child.score if parent.best_child is None else max(parent.best_child,
                                                                                       child.score)
                child.ancestors = [parent.id, *parent.ancestors]
            if child.score is None or child.state in known or child.id in self.nodes:
                continue
            self.nodes[child.id] = child
            known.add(child.state)
            added += 1
        self._prune()
        return added

    def _prune(self) -> None:
        if len(self.nodes) <= self.size:
            return
        keep = sorted((n for n in self.nodes.values() if n.id != ROOT),
                      key=lambda n: (-(n.score if n.score is not None else -math.inf), _order(n)))
        self.nodes = {ROOT: self.nodes[ROOT], **{n.id: n for n in keep[: self.size - 1]}}


def _order(node: Node) -> tuple[int, str]:
    """Older first: the root, then by step, then by id."""
    return (-1 if node.id == ROOT else node.step or 0, node.id)
