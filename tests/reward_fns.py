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


# labellers for reward.refresh_labeller: fn(prompts, answers_a, answers_b)

LABELLED: list[tuple[list[str], list[str], list[str]]] = []  # prefer_shorter's calls


def prefer_shorter(prompts, answers_a, answers_b):
    """Labels the head 'brevity' by name: 1 where answer a has fewer words, 0 where b has,
    0.5 for a tie; records each call in LABELLED."""
    LABELLED.append((list(prompts), list(answers_a), list(answers_b)))
    labels = []
    for a, b in zip(answers_a, answers_b):
        la, lb = len(a.split()), len(b.split())
        labels.append(0.5 if la == lb else float(la < lb))
    return {"brevity": labels}


def a_always(prompts, answers_a, answers_b):
    """A plain list: the head 'preference' (or a one-head model's head), a always better."""
    return [1.0] * len(prompts)


def too_few_labels(prompts, answers_a, answers_b):
    return [1.0]


def bad_json(prompts, responses):
    import json

    return json.loads("{not json")  # the line a user fixes: inside the json module it raised
