"""Regenerate sentiment_train.jsonl / sentiment_target.jsonl: 200 short labelled sentences.

Two classes: 1 (a pleased remark) and 0 (a displeased one), about everyday things.
Run from anywhere: ``python tests/data/make_sentiment.py``; the output is deterministic.
"""

import json
import random
from pathlib import Path

SUBJECTS = [
    "the soup", "this bike", "the hotel room", "our new neighbour", "the train ride", "that movie",
    "the garden", "my old laptop", "the concert", "this coffee", "the museum tour", "the bakery on the corner",
    "the hiking trail", "the library", "the new phone", "the pizza", "the ferry", "this winter coat",
    "the repair shop", "the football match", "the dentist", "the school play", "the camping trip", "the bus",
    "the paint job",
]
GOOD = [
    "was wonderful", "made my day", "felt warm and friendly", "was a real delight", "worked perfectly",
    "was better than I hoped", "left everyone smiling", "was lovely", "was great fun", "was worth every penny",
]
BAD = [
    "was awful", "ruined my day", "felt cold and rude", "was a total letdown", "broke after an hour",
    "was worse than I feared", "left everyone grumpy", "was dreadful", "was a boring waste of time",
    "was not worth the money",
]
ENDINGS = ["", " today", " again", " last week", " this morning", " honestly"]


def main() -> None:
    rng = random.Random(7)
    rows = []
    for label, phrases in ((1, GOOD), (0, BAD)):
        seen = set()
        while len(seen) < 100:
            s = f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(phrases)}{rng.choice(ENDINGS)}."
            if s not in seen:
                seen.add(s)
                rows.append({"text": s, "label": label})
    rng.shuffle(rows)
    here = Path(__file__).parent
    for name, part in (("sentiment_train.jsonl", rows[:168]), ("sentiment_target.jsonl", rows[168:])):
        with open(here / name, "w") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
