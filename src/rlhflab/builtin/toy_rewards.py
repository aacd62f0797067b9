"""Small programmatic rewards for examples and tests (usable as ``module:function``)."""

from __future__ import annotations

from rlhflab.builtin.tasks import WORDS

_WORDS = set(WORDS)


def vocabulary_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of the answer's words that are words of the built-in task (0 for empty).

    A random-init model emits byte-pair soup, so this rises quickly under PPO: a visible
    signal for a one-minute example.
    """
    out = []
    for r in responses:
        words = r.split()
        out.append(sum(w in _WORDS for w in words) / len(words) if words else 0.0)
    return out


def cat_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """How often the token-level word 'cat' appears, per answer word (a one-token target)."""
    return [r.split().count("cat") / max(1, len(r.split())) for r in responses]


def vowel_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of the answer's characters that are vowels: dense, so even a tiny random
    model finds a gradient at once (used by the tests)."""
    return [sum(c in "aeiou" for c in r) / len(r) if r else 0.0 for r in responses]
