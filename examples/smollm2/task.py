"""A verifiable chat task for SmolLM2-135M-Instruct: single-digit sums.

Why this task: on 32 two-digit sums the de-quantised model answers 0–3 % correctly, which
leaves RL nothing to climb; single-digit sums start with some signal (measured in
docs/real-models.md). The 100 problems a + b (a, b in 0..9) are split once, by a fixed seed,
into 70 for training and 30 held out, so the held-out accuracy measures problems the policy
never trained on.

    python examples/smollm2/task.py OUT_DIR   # writes OUT_DIR/train.jsonl, OUT_DIR/heldout.jsonl

``correct`` is both the PPO reward and the gold reward (the answer is checked, not judged):
1.0 when the last integer in the answer is the sum, else 0.0. The last, not the first: the
model often restates the question ("7 + 5 = 12"), and an answer cut off after restating it
("Here it is: 7 + ") ends on an operand and scores 0.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with just the number."
ASKED = re.compile(r"What is (\d) \+ (\d)\?")
INTEGER = re.compile(r"-?\d+")


def problems(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held out): 70 and 30 of the 100 single-digit problems."""
    every = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(every)
    return every[:70], every[70:]


def write(out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, items in zip(("train", "heldout"), problems()):
        path = out / f"{name}.jsonl"
        with path.open("w") as f:
            for a, b in items:
                message = {"role": "user", "content": QUESTION.format(a=a, b=b)}
                f.write(json.dumps({"messages": [message]}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def correct(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the answer's last integer is the sum the prompt asks for."""
    scores = []
    for prompt, response in zip(prompts, responses):
        asked = ASKED.findall(prompt)
        if not asked:
            raise ValueError(f"not a single-digit sum prompt: {prompt[-80:]!r}")
        a, b = asked[-1]
        found = INTEGER.findall(response)
        scores.append(float(bool(found) and int(found[-1]) == int(a) + int(b)))
    return scores


if __name__ == "__main__":
    for path in write(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(path)
