"""The built-in instruction task: generated from a seed, checkable, with a gold reward.

Four small skills a tiny model learns in minutes — copy, reverse and sort a few words, and
add two small numbers. Every prompt has one right answer, so a *gold* reward exists:
correct, concise, no filler. A noisy teacher writes the SFT data (sometimes wrong, sometimes
flattering, sometimes repetitive) and a simulated annotator labels preference pairs with
known biases, which gives a proxy reward model with known flaws, as real ones have.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "cat dog sun moon tree fish bird star rain snow red blue green apple pear lime "
    "bread milk salt rock"
).split()
SKILLS = ("copy", "reverse", "sort", "add")
FLATTERY_EN = ("Great question!", "I'm happy to help!")
FLATTERY_ZH = ("这是一个很好的问题！", "我很乐意帮助你！")
FLATTERY = FLATTERY_EN + FLATTERY_ZH
ANSWER_CUE = "\nanswer:"


@dataclass(frozen=True)
class Example:
    skill: str
    prompt: str
    answer: str  # the correct, concise answer (no leading space)


def make_example(rng: random.Random, skills: tuple[str, ...] = SKILLS) -> Example:
    skill = rng.choice(skills)
    if skill == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Example(skill, f"add: {a} {b}{ANSWER_CUE}", str(a + b))
    words = rng.sample(WORDS, rng.randint(2, 3))
    arg = " ".join(words)
    answer = {"copy": words, "reverse": words[::-1], "sort": sorted(words)}[skill]
    return Example(skill, f"{skill}: {arg}{ANSWER_CUE}", " ".join(answer))


def skills_of(task: str) -> tuple[str, ...]:
    """The skills of ``data.task``: 'mixed' is all four, any other one skill."""
    if task == "mixed":
        return SKILLS
    if task not in SKILLS:
        raise ValueError(f"data.task: {task!r} is not 'mixed' or one of {SKILLS}")
    return (task,)


def make_examples(n: int, seed: int, skills: tuple[str, ...] = SKILLS) -> list[Example]:
    """``n`` examples, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_example(rng, skills) for _ in range(n)]


def answer_for(prompt: str) -> str:
    """Recompute the correct answer from a prompt (the task is self-checking)."""
    head, _, rest = prompt.partition(": ")
    args = rest.replace(ANSWER_CUE, "").split()
    if head == "add":
        return str(sum(int(a) for a in args))
    if head == "copy":
        return " ".join(args)
    if head == "reverse":
        return " ".join(args[::-1])
    if head == "sort":
        return " ".join(sorted(args))
    raise ValueError(f"not a built-in task prompt: {prompt!r}")


# ----------------------------------------------------------------------------- analysing answers


def strip_flattery(text: str) -> tuple[str, bool]:
    found = False
    for phrase in FLATTERY:
        if phrase in text:
            text, found = text.replace(phrase, " "), True
    return " ".join(text.split()), found


def is_repetitive(words: list[str]) -> bool:
    """True when some word-bigram occurs twice, or the answer is its own repetition."""
    grams = list(zip(words, words[1:]))
    return len(grams) != len(set(grams)) or (len(words) >= 2 and len(set(words)) == 1)


@dataclass(frozen=True)
class Judgement:
    correct: float  # 1 exact, else partial credit in [0, 0.5]
    flattery: bool
    repetitive: bool
    extra_words: int
    gold: float


def judge(prompt: str, response: str) -> Judgement:
    """Gold reward: correctness − 0.5·flattery − 0.5·repetition − 0.1·extra words, in [−1.3, 1].

    Flattery is counted on the raw response; correctness on the response with flattery
    removed, so a flattering right answer is still right but scores less.
    """
    expected = answer_for(prompt).split()
    core, flattery = strip_flattery(response)
    words = core.split()
    if words == expected:
        correct = 1.0
    else:
        overlap = sum(1 for a, b in zip(words, expected) if a == b)
        correct = 0.5 * overlap / max(len(expected), len(words), 1)
    repetitive = is_repetitive(words) and words != expected
    extra = max(0, len(words) - len(expected))
    gold = correct - 0.5 * flattery - 0.5 * repetitive - 0.1 * min(extra, 3)
    return Judgement(correct, flattery, repetitive, extra, gold)


def gold_reward(prompts: list[str], responses: list[str]) -> dict[str, list[float]]:
    """The gold reward as a ``module:function`` reward source (``rlhflab.builtin.tasks:gold_reward``)."""
    js = [judge(p, r) for p, r in zip(prompts, responses)]
    return {"gold": [j.gold for j in js]}


# ----------------------------------------------------------------------------- teacher, annotator


def wrong_answer(ex: Example, rng: random.Random) -> list[str]:
    """A plausible mistake: off-by-one sums; shuffled, dropped, swapped-in or extra words."""
    if ex.skill == "add":
        return [str(max(0, int(ex.answer) + rng.choice((-2, -1, 1, 2))))]
    right = ex.answer.split()
    for _ in range(20):
        words = right[:]
        mode = rng.choice(("shuffle", "drop", "substitute", "extra"))
        if mode == "shuffle":
            rng.shuffle(words)
        elif mode == "drop":
            words.pop(rng.randrange(len(words)))
        elif mode == "substitute":
            words[rng.randrange(len(words))] = rng.choice(WORDS)
        else:
            words.insert(rng.randrange(len(words) + 1), rng.choice(WORDS))
        if words != right:
            return words
    return right[::-1] if len(set(right)) > 1 else right + right[:1]


def teacher_response(
    ex: Example, rng: random.Random, p_wrong=0.3, p_flattery=0.3, p_repeat=0.2
) -> str:
    """A noisy teacher: right most of the time, sometimes wrong, flattering or repetitive."""
    words = ex.answer.split()
    if rng.random() < p_wrong:
        words = wrong_answer(ex, rng)
    if rng.random() < p_repeat:
        words = words + words
    text = " ".join(words)
    if rng.random() < p_flattery:
        text = f"{rng.choice(FLATTERY)} {text}"
    return text


@dataclass(frozen=True)
class Preference:
    prompt: str
    chosen: str
    rejected: str
    labels: dict  # per attribute: 1 if `chosen` is better on it, 0 if worse, 0.5 tie


ATTRIBUTES = ("correctness", "brevity", "politeness")


def annotate(
    prompt: str,
    a: str,
    b: str,
    rng: random.Random,
    noise: float = 0.3,
    length_bias: float = 0.0,
    flattery_bias: float = 0.0,
) -> Preference:
    """Simulated annotator: Bradley-Terry on gold reward + biases, temperature ``noise``.

    The overall choice puts ``chosen`` first. Per-attribute labels are noise-free readings:
    correctness (gold correctness), brevity (fewer words), politeness (flattery present).
    """
    ja, jb = judge(prompt, a), judge(prompt, b)

    def utility(text: str, j: Judgement) -> float:
        return j.gold + length_bias * len(text.split()) + flattery_bias * j.flattery

    diff = (utility(a, ja) - utility(b, jb)) / max(noise, 1e-6)
    p_a = 1.0 / (1.0 + math.exp(-max(min(diff, 50.0), -50.0)))
    a_first = rng.random() < p_a
    chosen, rejected = (a, b) if a_first else (b, a)
    jc, jr = (ja, jb) if a_first else (jb, ja)

    def cmp(x: float, y: float) -> float:
        return 1.0 if x > y else 0.0 if x < y else 0.5

    labels = {
        "correctness": cmp(jc.correct, jr.correct),
        "brevity": cmp(-len(chosen.split()), -len(rejected.split())),
        "politeness": cmp(float(jc.flattery), float(jr.flattery)),
    }
    return Preference(prompt, chosen, rejected, labels)


def tokenizer_corpus() -> list[str]:
    """Deterministic text covering the task's prompts, answers and filler phrases."""
    rng = random.Random(1234)
    lines = []
    for ex in make_examples(400, seed=1234):
        lines.append(ex.prompt + " " + teacher_response(ex, rng))
    lines += [f"{p} {p}" for p in FLATTERY] * 20
    lines += [f"user: {ex.prompt}\nassistant: {ex.answer}" for ex in make_examples(50, 99)]
    return lines
