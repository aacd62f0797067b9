"""Reward functions that misbehave on purpose, for the error-message and edge-case tests."""


def wrong_count(prompts, responses):
    return [1.0]


def boom(prompts, responses):
    return 1 / 0


def nan_reward(prompts, responses):
    return [float("nan")] * len(prompts)


def zero_reward(prompts, responses):
    """A 0/1 reward that nobody earns: every score of a batch equal."""
    return [0.0] * len(prompts)
