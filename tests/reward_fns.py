"""Reward functions that misbehave on purpose, for the error-message tests."""


def wrong_count(prompts, responses):
    return [1.0]


def boom(prompts, responses):
    return 1 / 0


def nan_reward(prompts, responses):
    return [float("nan")] * len(prompts)
