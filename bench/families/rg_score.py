"""The rules reasoning-gym 0.1.25 scores its arithmetic families by, written here as a practice verifier function
(`rg_score:score`) so that the sandbox needs no reasoning-gym: `decimal` as its compute_decimal_reward (chain_sum,
products), `exact` as ProceduralDataset.score_answer (gcd, lcm, basic_arithmetic). Both give a correct but wordy
answer partial credit: len(answer expected) / len(answer given) when the expected answer is in it.
The answer is stripped of surrounding whitespace first, as reasoning-gym's own evaluation extracts it.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any


def decimal_reward(answer: str, oracle: str) -> float:
    """1.0 when the answer is the oracle as a number (sign, leading zeros, trailing decimals and commas
    tolerated), else the oracle's share of the answer's length when the answer holds it, else 0."""
    if not answer:
        return 0.0
    answer, oracle = answer.replace(",", ""), oracle.replace(",", "")
    try:
        if Decimal(answer) == Decimal(oracle):
            return 1.0
    except (InvalidOperation, ValueError):
        pass
    return len(oracle) / len(answer) if oracle in answer else 0.0


def exact_reward(answer: str, oracle: str) -> float:
    """1.0 for the oracle itself, else the oracle's share of the answer's length when the answer holds it."""
    if not answer:
        return 0.0
    if answer == oracle:
        return 1.0
    return len(oracle) / len(answer) if oracle in answer else 0.0


def score(answer: str, task: dict[str, Any]) -> float:
    """The task's own scorer (`scorer`: decimal or exact) on the stripped answer."""
    reward = decimal_reward if task["scorer"] == "decimal" else exact_reward
    return reward(answer.strip(), str(task["answer"]))
