"""The "Answer in one word." task of bench/learning.py: its prompts and its scorer.

Three disjoint prompt sets (training, held-out, the gate's own) and `one_word`, which reefd's holdout
gate imports by the dotted path `bench.learning_tasks:one_word`. Knows nothing about models or reefd.
"""

from __future__ import annotations

import re
from typing import Any

SUFFIX = " Answer in one word."

# Open questions with a natural one-word answer; the three lists share none.
TRAIN = [
    "What colour is the sky?", "What animal says moo?", "What is frozen water called?",
    "What do bees make?", "Which season comes after winter?", "What colour is grass?",
    "What is the opposite of hot?", "What do you call a baby dog?", "Which planet do we live on?",
    "What fruit is yellow and curved?", "What do cows drink?", "What is the largest ocean?",
    "What gas do plants absorb?", "What do you use to write on a blackboard?", "What colour is snow?",
    "Which organ pumps blood?", "What do spiders spin?", "What is the capital of France?",
    "What metal is a wedding ring often made of?", "What do you wear on your feet?",
    "Which bird is a symbol of peace?", "What falls from clouds when it rains?", "What do fish breathe with?",
    "What is the main ingredient of bread?", "Which animal has a trunk?", "What shape is a ball?",
    "What instrument has 88 keys?", "What do you call a house made of ice?", "What colour is a ripe tomato?",
    "Which month comes after June?", "What does a thermometer measure?", "What is the fastest land animal?",
    "What do caterpillars turn into?", "Which language is spoken in Brazil?", "What do you sleep on?",
    "What is the opposite of up?", "What do you call a young cat?", "Which star is closest to Earth?",
    "What drink is made from grapes?", "What do you call the meal eaten in the morning?",
    "What tool cuts paper?", "Which continent is Egypt in?", "What is the colour of coal?",
    "What do hens lay?", "Which sense uses the nose?", "What is the capital of Italy?",
    "What animal is known as the king of the jungle?", "What covers a bird's body?",
    "What do you call frozen rain?", "Which vegetable makes people cry when cut?", "What sport uses a puck?",
    "What is the largest mammal?", "What do you call a person who flies planes?", "Which day comes after Monday?",
    "What is used to unlock a door?", "What colour are most leaves in summer?", "What do we breathe in to live?",
    "Which insect glows at night?", "What is the opposite of day?", "What do you call a group of wolves?",
]
HELDOUT = [
    "What colour is a banana?", "What animal barks?", "What is the capital of Spain?",
    "Which planet is known as the red planet?", "What do you drink when you are thirsty?",
    "What is the opposite of big?", "What do you call a baby cow?", "Which season is the coldest?",
    "What colour is the sun?", "What do you use to see?", "Which animal has black and white stripes?",
    "What is the capital of Germany?", "What do birds build to lay eggs in?", "What do you call a baby sheep?",
    "Which fruit keeps the doctor away?", "What is the opposite of wet?", "What do you use to eat soup?",
    "Which ocean lies between Europe and America?", "What is the colour of milk?", "What do squirrels eat?",
    "What do you call a shop that sells medicine?", "Which metal is liquid at room temperature?",
    "What is the largest planet?", "What do you call a doctor for animals?",
]
GATE = [
    "What colour is an orange?", "What animal gives us wool?", "What is the capital of Japan?",
    "What do you call a baby horse?", "Which bird cannot fly and lives in Antarctica?",
    "What is the opposite of slow?", "What do you write with?", "Which month has the fewest days?",
]

_WORD = re.compile(r"[^\W_]", re.UNICODE)  # a word holds at least one letter or digit


def prompt(question: str) -> str:
    return question + SUFFIX


def words(text: str) -> int:
    return sum(1 for token in text.split() if _WORD.search(token))


def score(text: str) -> float:
    """1 when the answer has 1-3 words, else 0 (an empty or rambling answer fails)."""
    return 1.0 if 1 <= words(text) <= 3 else 0.0


def one_word(text: str, task: Any) -> float:
    """The gate's scorer (reefd.commit.gates: `pkg.mod:fn(text, task) -> [0, 1]`); the task is not needed."""
    return score(text)
