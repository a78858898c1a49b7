"""The simulated user of bench/openclaw_demo.py, and the scripted judge that reads its messages.

The user has a hidden preference: every answer should start with an opening (REEF_DEMO_OPENING, "Hello" by
default). It says so only as a correction ("Please start your answer with '...'.") when an answer misses it, and
otherwise moves on to its next question. The scripted judge is a Python function (`recipe.params.judge.model:
bench.openclaw_user:judge`): it reads the user's next message as a human rater would, and the demo labels every
result it produces as coming from a scripted judge.
"""

from __future__ import annotations

import os
import re

from reefd.grow.judge import JudgeCall

TRAIN = [
    "What is the capital of France?", "Name a prime number.", "What colour is the sky?",
    "How many legs does a spider have?", "What is 2 plus 3?", "Who wrote Hamlet?", "What is water made of?",
    "Name a fruit that is yellow.", "What is the largest ocean?", "How many days are in a week?",
    "What do bees make?", "What is the opposite of hot?", "Which planet is closest to the Sun?",
    "What language is spoken in Spain?", "How many minutes are in an hour?", "What animal says moo?",
    "What is frozen water called?", "Name a musical instrument.", "What shape has three sides?",
    "What do plants need to grow?", "Which season comes after winter?", "What is the capital of Japan?",
    "How many wheels does a bicycle have?", "What gas do we breathe in?",
]
HELD_OUT = [
    "What is the capital of Italy?", "Name an even number.", "What colour is grass?", "How many legs does a cat have?",
    "What is 4 plus 4?", "Who painted the Mona Lisa?", "What is ice made of?", "Name a red fruit.",
    "What is the tallest animal?", "How many months are in a year?", "What do cows drink?",
    "What is the opposite of up?", "Which planet do we live on?", "What language is spoken in Brazil?",
    "How many hours are in a day?", "What animal barks?",
]


def opening() -> str:
    return os.environ.get("REEF_DEMO_OPENING", "Hello")


def complies(answer: str, wanted: str | None = None) -> bool:
    return answer.strip().lower().startswith((wanted or opening()).lower())


def correction(wanted: str | None = None) -> str:
    return f"Please start your answer with '{wanted or opening()}'."


def reply(answer: str, next_question: str, wanted: str | None = None) -> str:
    """What the user says after an answer: a correction when it misses the preference (`wanted`, by default
    REEF_DEMO_OPENING), else the next question."""
    return correction(wanted) if not complies(answer, wanted) else f"Thanks! {next_question}"


ASKED = re.compile(r"please start your answer with '([^']+)'", re.IGNORECASE)


def judge(call: JudgeCall) -> str:
    """The scripted judge: a correction is -1 with a hint naming the opening the user asked for; the user moving
    on is +1, without one. Each user's correction names their own opening, so one judge serves many users."""
    said = " ".join(str(m.get("content", "")) for m in call.next_state)
    asked = ASKED.search(said)
    if call.kind == "verdict":
        return "The user asks for a change: \\boxed{-1}" if asked else "The user moves on: \\boxed{1}"
    if asked:
        return f"\\boxed{{1}} [HINT_START]Start every answer with '{asked.group(1)}'.[HINT_END]"
    return "\\boxed{-1}"
